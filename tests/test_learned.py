"""What the online planner learned, kept from one run to the next (`planning.learned`): the next
load plans from it, restores it exactly, ignores a file that does not fit, and output stays
exact."""

import json
import random
import shutil

import pytest

from offload_engine.planning import learned
from offload_engine.planning.adaptive import AcceptanceEstimate
from sequoia_trees.acceptance import AcceptanceVector
from tiny_models import greedy_past_eos, make_tiny_pair, perturbed_copy

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, _ = make_tiny_pair(tmp_path_factory.mktemp("learned"))
    # a draft that disagrees now and then: what a run learns differs from the measured vector
    return target, perturbed_copy(target, tmp_path_factory.mktemp("learned_draft") / "draft", 0.05, seed=3)


def _fake_measure(engine, *a, **k):
    from test_auto_tree import _fake_profile
    return _fake_profile(engine, pass_s=0.05, draft_s=2e-3)


@pytest.fixture(scope="module")
def measured_vectors(pair, tmp_path_factory):
    """The pair's acceptance vectors as the first `--tree auto` load measures and caches them
    (`measure.vectors_for`: 0.7 s of decoding), measured once for the module: each test's fresh
    cache starts with a copy, instead of every test's first load measuring the same vectors again.
    What is under test here is what the planner learns on top of them."""
    import offload_engine.planning.profiler as profiler
    from offload_engine.speculation.acceptance_store import acceptance_cache_dir
    with pytest.MonkeyPatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("learned_vectors")))
        m.setattr(profiler, "measure", _fake_measure)
        _load(pair).close()
        folder = acceptance_cache_dir()
    assert sorted(p.name.rsplit("__", 1)[1] for p in folder.glob("*.json")) == ["t0.6.json", "t0.json"]
    return folder


@pytest.fixture
def fake_profile(tmp_path, monkeypatch, measured_vectors):
    import offload_engine.planning.profiler as profiler
    from offload_engine.speculation.acceptance_store import acceptance_cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(profiler, "measure", _fake_measure)
    shutil.copytree(measured_vectors, acceptance_cache_dir())


def _load(pair, **kw):
    from offload_engine import Engine
    eng = Engine.load(pair[0], draft=pair[1], tree="auto", progress=False, **kw)
    eng.eos_token_ids = frozenset()
    return eng


def test_a_restored_estimate_goes_on_exactly_as_the_one_it_was_saved_from():
    """Evidence A (an answer), the state saved and restored into a fresh estimate, then evidence B
    (the next answer): the same counts (to rounding) as one estimate that saw A and B."""
    prior = AcceptanceVector((0.6, 0.2, 0.1, 0.05))
    rng = random.Random(5)
    evidence = [(rng.randint(1, 4), rng.choice([None, 0, 0, 1, 2])) for _ in range(300)]
    one, first = AcceptanceEstimate(prior), AcceptanceEstimate(prior)
    for i, (k, r) in enumerate(evidence):
        r = None if r is not None and r >= k else r
        one.observe(k, r)
        if i < 150:
            first.observe(k, r)
        if i % 3 == 2:
            one.fade()
            if i < 150:
                first.fade()
        if i == 149:  # (the first answer ends: saved between answers, as `learned.save` is)
            one.end_generation()
            first.end_generation()
    second = AcceptanceEstimate(AcceptanceVector((0.9, 0.1, 0.0, 0.0)))  # (another prior: overwritten)
    state = json.loads(json.dumps({"h": first.prior_h, "a": first.accepted, "n": first.at_risk, "s": first.steps}))
    second.restore(state["h"], state["a"], state["n"], state["s"])
    for i, (k, r) in enumerate(evidence[150:], start=150):
        r = None if r is not None and r >= k else r
        second.observe(k, r)
        if i % 3 == 2:
            second.fade()
    assert second.steps == one.steps == 100
    assert second.hazards() == pytest.approx(one.hazards(), rel=1e-12)  # (within the second answer)
    one.end_generation()
    second.end_generation()
    assert second.hazards() == pytest.approx(one.hazards(), rel=1e-12)
    assert second.vector().probs != prior.probs  # (the evidence moved it: the comparison means something)


def test_what_a_run_learned_is_kept_and_the_next_load_plans_from_it(pair, fake_profile):
    plain = greedy_past_eos(pair[0], PROMPT, 40)[0].token_ids
    with _load(pair, remember=True) as eng:
        stored = eng.auto_plans[0.0].vector
        assert eng.auto_plans[0.0].learned is None  # (nothing learned yet)
        path = eng.learned_paths[0.0][0]
        first = eng.generate(PROMPT, max_new_tokens=40)
        assert first.token_ids == plain
        planner = eng.planners[0.0]
        assert planner.accept.steps == first.stats["target_steps"] - planner.log.plain_steps > 0
        saved = json.loads(path.read_text())
        assert saved["accepted"] == planner.accept.accepted and saved["generations"] == 1
        learned_vector = planner.accept.vector()
    assert learned_vector.probs != stored.probs
    # the next load: its plan is made from the learned vector, its planner goes on from the counts
    with _load(pair, remember=True) as eng:
        plan = eng.auto_plans[0.0]
        assert plan.learned == saved and plan.vector.probs == pytest.approx(learned_vector.probs, abs=1e-12)
        assert "learned from" in plan.source
        from sequoia_trees.optimizer import Candidates
        assert plan.candidates.acceptance.probs == plan.vector.probs  # (the DP table filled with it)
        assert isinstance(plan.candidates, Candidates)
        from sequoia_trees.sampling import SamplingParams
        _, restored = eng._planner(SamplingParams(temperature=0.0))
        assert restored.accept.accepted == saved["accepted"] and restored.accept.at_risk == saved["at_risk"]
        assert restored.accept.prior_h == saved["prior_hazards"] and restored.generations == 1
        again = eng.generate(PROMPT, max_new_tokens=40)
        assert again.token_ids == plain  # (exact whatever the planner starts from)
        assert json.loads(path.read_text())["generations"] == 2
    # without remembering: the stored vector, and nothing written
    before = path.read_text()
    with _load(pair) as eng:
        assert eng.auto_plans[0.0].learned is None and eng.auto_plans[0.0].vector.probs == stored.probs
        assert eng.generate(PROMPT, max_new_tokens=40).token_ids == plain
    assert path.read_text() == before


def test_learned_answer_lengths_plan_the_load_time_choice(pair, fake_profile):
    """Three answers that ended on their own after 6 tokens: the next load plans for 6-token
    answers (as the planner would within one run), not for max_new_tokens."""
    with _load(pair, remember=True, plan_tokens=128) as eng:
        assert eng.auto_plans[0.0].length == 127
        path = eng.learned_paths[0.0][0]
        out = eng.generate(PROMPT, max_new_tokens=24)
        eng.eos_token_ids = frozenset({out.token_ids[6]})
        for _ in range(3):
            assert eng.generate(PROMPT, max_new_tokens=24).finish_reason == "stop"
    state = json.loads(path.read_text())
    assert state["ended"] == [6, 6, 6]
    with _load(pair, remember=True, plan_tokens=128) as eng:
        plan = eng.auto_plans[0.0]
        assert plan.length == 6 and "the lengths of the last 3 that ended on their own" in plan.source
        assert plan.choice == plan.candidates.best(plan.timings, length=6)


DAMAGES = {  # a cache file anyone could have written: each is skipped, none stops the load
    "garbage": lambda good: '{"version": 1, "accepted": [',
    "nested": lambda good: "[" * 100_000 + "]" * 100_000,
    "long-digits": lambda good: json.dumps({**good, "tree_steps": 0}).replace('"tree_steps": 0', '"tree_steps": ' + "9" * 5000),
    "huge-int": lambda good: json.dumps({**good, "accepted": [10 ** 400] + good["accepted"][1:]}),
    "huge-length": lambda good: json.dumps({**good, "ended": [10 ** 400]}),
    "too-many-lengths": lambda good: json.dumps({**good, "ended": [5] * 17}),
    "other-prior": lambda good: json.dumps({**good, "prior": [0.5] + good["prior"][1:]}),
    "other-hazards": lambda good: json.dumps({**good, "prior_hazards": [0.5] * len(good["prior"])}),
    "negative": lambda good: json.dumps({**good, "at_risk": [-1.0] + good["at_risk"][1:]}),
    "more-accepted-than-tried": lambda good: json.dumps({**good, "accepted": [x + 100.0 for x in good["accepted"]]}),
    # (a hazard of 1.000001 made a negative probability, and the vector refused it)
    "slack": lambda good: json.dumps({**good, "accepted": [0.0] * len(good["prior"]),
                                      "at_risk": [0.0] * len(good["prior"])}).replace(
        '"accepted": [0.0', '"accepted": [1e-06', 1).replace('"prior_hazards": [', '"prior_hazards": [', 1),
    "a-list": lambda good: json.dumps([good]),
    "bool-counts": lambda good: json.dumps({**good, "generations": True}),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_learned_file_that_does_not_fit_is_ignored_with_a_note_and_replaced(pair, fake_profile, capsys, damage):
    from offload_engine import Engine
    with _load(pair, remember=True) as eng:
        path, stored = eng.learned_paths[0.0]
        eng.generate(PROMPT, max_new_tokens=24)
    good = json.loads(path.read_text())
    path.write_text(DAMAGES[damage](good))
    capsys.readouterr()
    eng = Engine.load(pair[0], draft=pair[1], tree="auto", progress=True, remember=True)
    eng.eos_token_ids = frozenset()
    with eng:
        err = capsys.readouterr().err
        assert f"not using {path}" in err and "starts from" in err, err
        assert "Traceback" not in err
        assert eng.auto_plans[0.0].learned is None and eng.auto_plans[0.0].vector.probs == stored.probs
        eng.generate(PROMPT, max_new_tokens=24)
    assert learned.load(path, stored)[1] is None  # (replaced by a usable state)
    assert not list(path.parent.glob(".*tmp*"))  # (written whole: no temporary left)


def test_a_cache_that_cannot_be_written_costs_the_next_run_not_this_answer(pair, fake_profile, capsys):
    """The learned folder's place taken by a file: the answer is whole and exact, one line says the
    state is not kept (once), and nothing is left behind."""
    plain = greedy_past_eos(pair[0], PROMPT, 24)[0].token_ids
    learned.folder().parent.mkdir(parents=True, exist_ok=True)
    learned.folder().write_text("not a folder")
    capsys.readouterr()
    with _load(pair, remember=True) as eng:
        assert [eng.generate(PROMPT, max_new_tokens=24).token_ids for _ in range(2)] == [plain, plain]
    err = capsys.readouterr().err
    assert err.count("cannot keep what the planner learned") == 1 and "Traceback" not in err, err
    assert learned.folder().read_text() == "not a folder"


def test_a_variant_of_a_remembering_engine_keeps_nothing(pair, fake_profile):
    """`Engine.variant` (the benchmarks' modes on one engine) starts its planners afresh from the
    load's state: they would overwrite the base's file, so they write nothing."""
    with _load(pair, remember=True) as eng:
        path = eng.learned_paths[0.0][0]
        v = eng.variant()
        v.generate(PROMPT, max_new_tokens=24)
        assert not path.exists()
        eng.generate(PROMPT, max_new_tokens=24)
        assert path.exists()


def test_the_cli_remembers_unless_told_to_forget(pair, fake_profile, tmp_path, capsys):
    from offload_engine.apps.cli import main
    base = ["generate", "--target", str(pair[0]), "--draft", str(pair[1]), "--device", "cpu",
            "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]
    folder = learned.folder()
    assert main([*base, "--forget"]) == 0
    assert not folder.exists() or not list(folder.glob("*.json"))
    capsys.readouterr()
    assert main(base) == 0
    auto = json.loads(capsys.readouterr().out)["stats"]["auto"]
    # (the start's prediction with the range 8 in 10 answers of the planned length measure)
    low, high = auto["predicted_speedup_range"]
    assert auto["predicted_for_tokens"] == 12 and low < auto["predicted_speedup"] < high
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["generations"] == 1
    assert main(base) == 0
    assert json.loads(files[0].read_text())["generations"] == 2
    assert main([*base, "--forget"]) == 0
    assert json.loads(files[0].read_text())["generations"] == 2


def test_the_stats_range_is_the_one_printed_at_the_start_of_the_answer(pair, fake_profile, monkeypatch):
    """A planner that refills its candidates every step (the acceptance estimate moved): the stats
    line's range is the one the start's candidates gave (a range read at the end, from the refilled
    table, once printed 1.9-3.0x beside a 3.47x prediction made from the first one)."""
    from offload_engine.planning import adaptive
    for name, value in (("EVERY", 1), ("REFILL_DISTANCE", 0.0), ("REPLAN_SHARE", 10.0), ("PRIOR_NODES", 1.0)):
        monkeypatch.setattr(adaptive, name, value)
    with _load(pair, plan_tokens=40) as eng:
        plan = eng.auto_plans[0.0]
        fresh = adaptive.OnlinePlanner(plan.vector, plan.timings, plan.candidates, True, plan.choice)
        fresh.step_error = plan.step_error
        fresh.begin(39)
        result = eng.generate(PROMPT, max_new_tokens=40)
        planner = eng.planners[0.0]
    auto = result.stats["auto"]
    assert fresh.log.start_spread is not None and planner.candidates is not plan.candidates  # (it refilled)
    assert auto["predicted_speedup_range"] == pytest.approx(list(fresh.log.start_spread), rel=1e-12)
    assert auto["predicted_speedup_range"][0] < auto["predicted_speedup"] < auto["predicted_speedup_range"][1]


def test_an_answer_that_ends_sooner_than_planned_gets_the_start_s_prediction_for_its_own_length(
        pair, fake_profile, monkeypatch):
    """An answer that ends by its end-of-sequence token before the planned length: the stats give
    the start's tree predicted for the tokens its steps made, from the start's candidates and
    timings (the planner refilling its candidates every step notwithstanding), with the range of
    speed-ups such answers measure, and the stats line prints both beside the planned length's
    (the demo's start is planned for 128 tokens; its answer ends at 67). An answer that runs to
    the planned length has none."""
    from offload_engine.apps.cli import _auto_summary
    from offload_engine.planning import adaptive
    from offload_engine.planning.auto_tree import speedup_spread
    for name, value in (("EVERY", 1), ("REFILL_DISTANCE", 0.0), ("REPLAN_SHARE", 10.0), ("PRIOR_NODES", 1.0)):
        monkeypatch.setattr(adaptive, name, value)
    with _load(pair, plan_tokens=40) as eng:
        plain = eng.generate(PROMPT, max_new_tokens=40, plain=True).token_ids
        k = next(i for i in range(12, len(plain)) if plain[i] not in plain[:i])  # (the answer's last token)
        plan = eng.auto_plans[0.0]
        fresh = adaptive.OnlinePlanner(plan.vector, plan.timings, plan.candidates, True, plan.choice)
        fresh.step_error, fresh.spell = plan.step_error, plan.spell
        fresh.begin(39)
        start = fresh.log.start
        assert start.budget > 1
        eng.eos_token_ids = frozenset({plain[k]})
        result = eng.generate(PROMPT, max_new_tokens=40)
        assert result.token_ids == plain[:k + 1] and result.finish_reason == "stop"
        assert eng.planners[0.0].candidates is not plan.candidates  # (it refilled)
        auto = result.stats["auto"]
        made = auto["predicted_for_made"]
        want = plan.candidates.choice(start.budget, start.depth, plan.timings, k)  # (the steps made k)
        assert made["tokens"] == k + 1 and made["seconds_per_token"] == pytest.approx(want.seconds_per_token, rel=1e-12)
        assert made["speedup"] == pytest.approx(plan.timings.plain() / want.seconds_per_token, rel=1e-12)
        spread = speedup_spread(plan.candidates, want, plan.timings.plain(), k, plan.step_error, spell=plan.spell)
        assert made["speedup_range"] == pytest.approx(list(spread), rel=1e-12)
        # (a shorter answer's last step throws away more: it is predicted slower per token)
        assert made["seconds_per_token"] > auto["predicted_seconds_per_token"]
        line = _auto_summary(result.stats, auto)
        assert f"({made['seconds_per_token']:.3f} for an answer of {k + 1} tokens)" in line
        assert (f"for this answer's {k + 1} tokens {made['speedup']:.2f}x, 8 in 10: "
                f"{spread[0]:.1f}-{spread[1]:.1f}x)") in line
        eng.eos_token_ids = frozenset()
        full = eng.generate(PROMPT, max_new_tokens=40)
        assert full.finish_reason == "length" and full.stats["auto"]["predicted_for_made"] is None
        assert "for this answer's" not in _auto_summary(full.stats, full.stats["auto"])


def test_the_demo_plans_from_the_stored_vectors_and_keeps_nothing(pair, fake_profile, capsys):
    """`demo` neither reads what generate, chat and serve learned nor writes: its one canned prompt
    is no sample of the user's (planned from what the user's answers taught, the demo's easy
    answer measured 2.98-3.54x against 2.05-2.66x predicted; written back, its repeats taught the
    planner that one answer and the learned trees cycled, 2026-12-07)."""
    from offload_engine.apps.cli import main
    model = ["--target", str(pair[0]), "--draft", str(pair[1]), "--device", "cpu"]
    generate = ["generate", *model, "--prompt", PROMPT, "--max-new-tokens", "12"]
    assert main(generate) == 0
    files = list(learned.folder().glob("*.json"))
    assert len(files) == 1
    capsys.readouterr()
    assert main(generate) == 0  # (what generate learned, generate uses)
    assert "learned from" in capsys.readouterr().err
    kept = files[0].read_bytes()
    for extra in ([], ["--forget"]):  # (--forget: accepted, and the same)
        assert main(["demo", *model, *extra]) == 0
        err = capsys.readouterr().err
        assert "tree auto at T=0" in err and "learned from" not in err, err
        assert list(learned.folder().glob("*.json")) == files and files[0].read_bytes() == kept
    assert main(generate) == 0
    assert json.loads(files[0].read_text())["generations"] == 3  # (generate still keeps what it learns)
