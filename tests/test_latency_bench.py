"""The latency benchmark's --quick mode end to end on a tiny random pair: every row has every
field, and the T=0 exactness column is computed from the tokens (a deliberately broken
verifier shows as not equal)."""

import json
import statistics

import pytest

import offload_engine.planning.profiler as profiler
import offload_engine.planning.draft_choice as draft_choice
from benchmarks import latency
from offload_engine.apps.cli import main
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("latency")
    target = make_tiny_checkpoint(root / "t", "llama3-gqa", layers=2, seed=11, init_std=0.05)
    draft = make_tiny_checkpoint(root / "d", "llama3-gqa", layers=1, seed=12, init_std=0.05)
    prompts = root / "prompts.txt"
    prompts.write_text("Hello there\nThe cat sat\nOnce upon a time\n")
    return target, draft, prompts


def _args(pair, tmp_path, *extra):
    target, draft, prompts = pair
    return ["bench", "latency", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
            "--quick", "--out", str(tmp_path / "r.json"), *extra]


@pytest.fixture
def loads(monkeypatch) -> list:
    """The modes `latency._load` loads an engine for, in order."""
    seen, real_load = [], latency._load
    monkeypatch.setattr(latency, "_load", lambda args, m: seen.append(m["mode"]) or real_load(args, m))
    return seen


def _fast_profile(engine, *a, **k):
    from test_auto_tree import _fake_profile
    return _fake_profile(engine)


def test_quick_run_writes_every_field(pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", _fast_profile)
    assert main(_args(pair, tmp_path)) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    modes = {r["mode"] for r in res["rows"]}
    assert modes == {"plain-resident", "plain-streamed", "chain-16", "specinfer-16", "specexec-16", "sequoia-16",
                     "sequoia-auto", "auto-no-adapt", "best-fixed"}
    assert len(res["rows"]) == 2 * len(modes)  # T=0 and T=0.6
    for r in res["rows"]:
        for field in latency.FIELDS:
            assert field in r, (r["mode"], field)
        assert r["seconds_per_token"] > 0 and r["tokens_per_step"] >= 1.0
        assert (r["equal_to_plain"] is True) if r["temperature"] == 0 else (r["equal_to_plain"] is None), r
    streamed = [r for r in res["rows"] if r["mode"] != "plain-resident"]
    assert all(r["bytes_streamed_per_token"] > 0 for r in streamed)  # --offload disk: every pass reads the layers
    assert res["peer"] is not None and res["peer"]["equal_to_plain"] is True
    out = capsys.readouterr().out
    assert "| sequoia-16 | 0 |" in out and "peer: transformers+accelerate" in out


def test_auto_study_compares_auto_with_the_best_fixed_tree_in_hindsight(pair, tmp_path, monkeypatch, capsys, loads):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", _fast_profile)
    assert main(_args(pair, tmp_path, "--auto-study", "--hindsight", "4,3 8,3", "--no-peer", "--fresh-profile")) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"plain-streamed", "sequoia-4,3", "sequoia-8,3", "sequoia-auto",
                                         "auto-no-adapt", "plain-again", "plain-control", "best-fixed"}
    # every mode but plain-control runs on one engine (variants of the auto one): two loads in all
    assert sorted(loads) == ["base", "plain-control", "x"]  # (x: the engine that finds the profile to forget)
    for t in (0.0, 0.6):
        at = {r["mode"]: r for r in rows if r["temperature"] == t}
        fixed = [at[m] for m in ("plain-streamed", "sequoia-4,3", "sequoia-8,3")]
        best = min(fixed, key=lambda r: r["seconds_per_token"])
        assert at["best-fixed"]["seconds_per_token"] == best["seconds_per_token"]
        assert at["best-fixed"]["best_fixed_mode"] == best["mode"]
        for mode in ("sequoia-auto", "auto-no-adapt"):
            r = at[mode]
            assert r["vs_best_fixed"] == pytest.approx(best["seconds_per_token"] / r["seconds_per_token"])
            # the paired ratio: the median over the three prompts, each mode's own s/token on each
            assert len(r["seconds_per_token_by_prompt"]) == 3
            ratios = sorted(b / a for a, b in zip(r["seconds_per_token_by_prompt"], best["seconds_per_token_by_prompt"]))
            assert r["vs_best_fixed_paired"] == pytest.approx(ratios[1])
            plain = sorted(b / a for a, b in zip(r["seconds_per_token_by_prompt"],
                                                 at["plain-streamed"]["seconds_per_token_by_prompt"]))
            assert r["vs_plain_paired"] == pytest.approx(plain[1])
            assert len(r["per_prompt"]) == 3 and all(pp["predicted_seconds_per_token"] > 0 for pp in r["per_prompt"])
            assert "x" in r["trees"]
            # the second bar's figures once adapting: the two later answers' forecasts against their measurements
            later = r["per_prompt"][1:]
            ratios = [pp["forecast_seconds_per_token"] / pp["measured_seconds_per_token"] for pp in later]
            f = r["forecast_after_first"]
            assert f["answers"] == 2 and f["ratios"] == pytest.approx(ratios)
            assert f["within"] == sum(abs(x - 1) <= 0.10 for x in ratios)
            spent = [pp["measured_seconds_per_token"] * pp["tokens"] for pp in later]
            assert all(pp["tokens"] > 0 for pp in later)
            assert f["pooled"] == pytest.approx(sum(x * t for x, t in zip(ratios, spent)) / sum(spent))
        assert at["auto-no-adapt"]["trees"].count(" x ") == 1  # one tree throughout
        # the control: plain-streamed's configuration again (never the best fixed choice), its paired ratio
        for name in ("plain-control", "plain-again"):
            control = at[name]
            assert control["tokens_per_step"] == 1.0 and control["equal_to_plain"] is (True if t == 0 else None)
            assert at["best-fixed"]["best_fixed_mode"] != name
            ratios = sorted(b / a for a, b in zip(control["seconds_per_token_by_prompt"],
                                                   at["plain-streamed"]["seconds_per_token_by_prompt"]))
            assert control["vs_plain_paired"] == pytest.approx(ratios[1])
    out = capsys.readouterr().out
    assert "best fixed" in out and "again, the same engine" in out and "again, a second engine" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if "first generation: predicted / measured" in line)
    told = [line for line in lines[head + 2:] if line.startswith("|")]  # the predictions' table
    assert [line.split(" | ")[0] for line in told] == ["| sequoia-auto", "| auto-no-adapt"] * 2
    assert all(line.count(" of 2 |") == 1 for line in told)


def test_auto_study_separate_engines_loads_one_engine_per_mode(pair, tmp_path, monkeypatch, loads):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", _fast_profile)
    assert main(_args(pair, tmp_path, "--auto-study", "--hindsight", "4,3", "--no-peer", "--temperatures", "0",
                      "--separate-engines")) == 0
    assert sorted(loads) == sorted(["plain-streamed", "sequoia-4,3", "sequoia-auto", "auto-no-adapt", "plain-again",
                                    "plain-control"])
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert all(r["equal_to_plain"] for r in rows)


def test_draft_auto_study_compares_the_chosen_draft_with_the_best_single_one(pair, tmp_path, monkeypatch, capsys):
    """--draft-auto-study: plain, each candidate with --tree auto, --draft auto, and the best
    single draft in hindsight (computed); the tiny target has no committed default draft, so
    the candidates here are the self-drafts."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", _fast_profile)
    monkeypatch.setattr(latency, "DRAFT_CANDIDATES", ("self-int8", "self-q8"))
    # one switch forced after the first answer, and no other (what the run measures decides it
    # otherwise, and a short noisy run may or may not switch): the row must record it, and stay
    # exact across it
    forced = []

    def switch_once(choice, current, *a, **kw):
        if forced:
            return None
        forced.append(current)
        return ({"self-int8": "self-q8", "self-q8": "self-int8"}[current], 9.0)
    monkeypatch.setattr(draft_choice, "switch_target", switch_once)
    assert main(_args(pair, tmp_path, "--draft-auto-study", "--no-peer")) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"plain-streamed", "self-int8-auto", "self-q8-auto", "draft-auto",
                                         "best-single", "best-fixed"}
    for t in (0.0, 0.6):
        at = {r["mode"]: r for r in rows if r["temperature"] == t}
        single = min((at[m] for m in ("plain-streamed", "self-int8-auto", "self-q8-auto")),
                     key=lambda r: r["seconds_per_token"])
        assert at["best-single"]["best_fixed_mode"] == single["mode"]
        r = at["draft-auto"]
        assert r["vs_best_single"] == pytest.approx(single["seconds_per_token"] / r["seconds_per_token"])
        ratios = sorted(b / a for a, b in zip(r["seconds_per_token_by_prompt"], single["seconds_per_token_by_prompt"]))
        assert r["vs_best_single_paired"] == pytest.approx(statistics.median(ratios))
        assert r["equal_to_plain"] is (True if t == 0 else None)
        assert r["draft_chosen"] in ("self-int8", "self-q8")  # (a pick of none would not switch)
        # the chosen candidate's row runs on a variant of the draft-auto engine (one configuration,
        # one engine); the other candidates on engines of their own
        for name in ("self-int8", "self-q8"):
            assert at[f"{name}-auto"]["shared_engine"] is (name == r["draft_chosen"])
        assert "draft_chosen" not in at["self-q8-auto"] and not r["shared_engine"]
    assert "the best single draft" in capsys.readouterr().out
    # --draft auto choosing no draft: its row has no trees, and the table says so
    res = json.loads((tmp_path / "r.json").read_text())
    for r in res["rows"]:
        if r["mode"] == "draft-auto":
            r.pop("trees", None)
            r["draft_chosen"] = "none"
    assert "chose none; plain decoding" in latency.markdown(res)
    # a switch between answers: the row keeps it, and the table says after which prompt
    # the forced switch: recorded once, after the first answer at T=0, from the pick to the other
    switched = [(r["temperature"], w) for r in rows if r["mode"] == "draft-auto" for w in r["draft_switches"]]
    assert len(forced) == 1 and len(switched) == 1, (forced, switched)
    (t, w), = switched
    assert t == 0.0 and w["prompt"] == 0 and w["from"] == forced[0] and w["from"] != w["to"]
    assert w["from"] == next(r for r in rows if r["mode"] == "draft-auto")["draft_chosen"]
    assert w["to"] in ("self-int8", "self-q8") and w["seconds"] > 0 and "9.00x" in w["why"]
    r = next(r for r in res["rows"] if r["mode"] == "draft-auto")
    r["draft_switches"] = [{"prompt": 1, "from": "none", "to": "self-int8", "seconds": 0.5, "why": "w"}]
    assert "chose none; switched to self-int8 after prompt 2; plain decoding" in latency.markdown(res)


def test_suffix_study_rows_and_their_plot(pair, tmp_path, monkeypatch):
    """--suffix-study: plain, suffix, the model draft and the hybrid (auto and a fixed tree), with
    the suffix drafts' accepted tokens counted and the (T=0) tokens equal to plain decoding's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", _fast_profile)
    target, draft, _ = pair
    prompts = tmp_path / "rep.txt"
    prompts.write_text("one two three one two three one two three one two\nthe cat sat the cat sat the cat\n")
    args = ["bench", "latency", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
            "--max-new-tokens", "10", "--temperatures", "0", "--suffix-study", "--suffix-tree", "4,3", "--no-peer",
            "--out", str(tmp_path / "r.json")]
    assert main(args) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    modes = {"plain-streamed", "suffix", "suffix-rule", "model-auto", "hybrid-auto", "model-4,3", "hybrid-4,3"}
    assert modes <= {r["mode"] for r in rows}
    for r in rows:
        if r["mode"] in ("suffix", "suffix-rule", "hybrid-auto", "hybrid-4,3"):
            assert r["suffix_accepted_tokens"] >= 0 and "suffix_matched_steps" in r
        if r["temperature"] == 0:
            assert r["equal_to_plain"], r["mode"]


def test_a_broken_mode_shows_as_not_equal(pair, tmp_path, monkeypatch):
    """Verification that accepts the draft's first child whatever the target says: every
    speculative mode's tokens then differ from plain decoding, and the column says so."""
    import offload_engine.speculation.decoder as spec
    from sequoia_trees.verify import VerifyResult
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", _fast_profile)
    real = spec.verify_greedy_argmax

    def broken(parents, tokens, best):
        good = real(parents, tokens, best)
        kids = [i for i, p in enumerate(parents) if p == 0]
        if not kids:
            return good
        return VerifyResult((kids[0],), int(best[kids[0]]), (0,))

    monkeypatch.setattr(spec, "verify_greedy_argmax", broken)
    assert main(_args(pair, tmp_path, "--temperatures", "0", "--no-peer")) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert rows["plain-resident"]["equal_to_plain"] is True
    for mode in ("chain-16", "specinfer-16", "specexec-16", "sequoia-16"):
        assert rows[mode]["equal_to_plain"] is False, mode


def test_modes_takes_names_that_hold_commas():
    """Mode names hold commas ("sequoia-16,16", "model-4,3"): --modes matched them by splitting on
    commas and refused "sequoia-16,16" as "no mode 16, sequoia-16"."""
    from benchmarks.latency import wanted_modes
    names = ["plain-streamed", "sequoia-4,4", "sequoia-16,16", "sequoia-auto", "model-4,3", "hybrid-4,3", "suffix"]
    assert wanted_modes("sequoia-16,16,sequoia-auto", names) == ["sequoia-16,16", "sequoia-auto"]
    assert wanted_modes("sequoia-auto, sequoia-4,4", names) == ["sequoia-auto", "sequoia-4,4"]
    assert wanted_modes("model-4,3,hybrid-4,3,suffix", names) == ["model-4,3", "hybrid-4,3", "suffix"]
    assert wanted_modes("sequoia-16,17,suffix,", names) == ["sequoia-16", "17", "suffix"]  # (the caller reports)


def test_modes_runs_a_subset_with_its_baseline(pair, tmp_path, monkeypatch, capsys):
    """--modes: only the modes named, and plain-streamed (every ratio's baseline); a name that is
    not a mode of the run is one error that lists them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = _args(pair, tmp_path, "--suffix-study", "--temperatures", "0", "--no-peer")
    assert main(args + ["--modes", "suffix,suffix-rule"]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"plain-streamed", "suffix", "suffix-rule", "best-fixed"}
    assert all(r["equal_to_plain"] for r in rows)
    capsys.readouterr()
    assert main(args + ["--modes", "suffix,sufix"]) == 2
    err = capsys.readouterr().err
    assert "no mode sufix" in err and "suffix-rule" in err and "Traceback" not in err
