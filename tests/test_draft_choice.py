"""`--draft auto` (planning/draft_choice.py): the candidates at hand (self-drafts, a same-tokenizer
model beside the target, the named ones, none), the ones the memory budget cannot hold dropped
with the planner's reason, each other one predicted by its own profile and acceptance vectors
through `--tree auto`'s optimizer, the fastest loaded; the table cached while its profiles are;
`plan --draft auto` prints it; greedy output with the chosen draft equals plain decoding.

The profiles are fakes with known level times (one per candidate, so that the fastest is known
without timing a noisy machine) and the vectors a fixed one: what is under test is the choice,
not the measurements (tests/test_auto_tree.py and test_optimizer.py test those)."""

import gc
import json
import os
import weakref
from pathlib import Path

import pytest

from offload_engine import Engine
from offload_engine.apps.cli import main
from offload_engine.planning import draft_choice, profiler
from offload_engine.planning.hw_profile import MeasuredProfile
from offload_engine.speculation import measure
from sequoia_trees.acceptance import AcceptanceVector
from tiny_models import greedy_past_eos, make_tiny_checkpoint

# per candidate, a draft level's seconds: self-q4 the cheapest, the sibling model dearest but one
LEVEL_S = {"self-q8": 0.02, "self-q4": 0.005, "self-int8": 0.03, "self-int4": 0.01}
SIBLING_LEVEL_S = 0.04
PASS_S = 0.5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("choice")
    target = make_tiny_checkpoint(root / "target", "llama3-gqa", layers=8, seed=3, init_std=0.05)
    small = make_tiny_checkpoint(root / "small", "llama3-gqa", layers=1, seed=4, init_std=0.05)
    make_tiny_checkpoint(root / "twin", "llama3-gqa", layers=8, seed=5)  # as large as the target: not a draft
    return target, small


@pytest.fixture(scope="module", autouse=True)
def _imports_left_out_of_collections(folders):
    """Choosing a draft frees each candidate's engine with a full gc.collect() (draft_choice.choose_draft,
    Engine._free_draft): about a hundred of them in this module. In pytest's process each one also
    walks every object that the runner and the test modules imported before (over 400,000: 0.17 s
    a collection run alone, 18 of this module's 51 s), which the CLI's process does not hold.
    conftest.py freezes (gc.freeze) what is alive before the module starts; this freezes again once
    its checkpoints are made (transformers imported, when this module runs alone), so that each
    collection walks what the tests made since, and collects it as before (the switch test asserts
    that the replaced draft is freed before the next one is built); unfrozen after."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _fake_profile(engine, level_s: float) -> MeasuredProfile:
    ns, ws = (1, 16, 64, 128), (1, 8, 64)
    return MeasuredProfile(machine="test", device="cpu", dtype="float32", target=str(engine.folder),
                           target_fingerprint=engine.target_fingerprint, draft_key=engine.draft_key, plan={},
                           stream_source="none", stream_gb_per_s=0.0, prefix_tokens=128, target_tokens=ns,
                           target_pass_s=tuple(PASS_S for _ in ns), draft_widths=ws,
                           draft_level_s=tuple(level_s for _ in ws), step_residual_s=0.0,
                           draft_level_greedy_s=tuple(level_s for _ in ws), step_residual_greedy_s=0.0,
                           measured_at="now", measure_s=0.0)


@pytest.fixture
def fakes(folders, tmp_path, monkeypatch):
    """Each candidate's profile from LEVEL_S; a fixed vector for every pair; the candidates
    each evaluation loaded, in order."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, small = folders
    loaded = []

    def fake_measure(engine, *a, **k):
        key = str(engine.draft_key)
        loaded.append(key)
        level = next((v for name, v in LEVEL_S.items() if key.startswith(name)), SIBLING_LEVEL_S)
        return _fake_profile(engine, level)
    monkeypatch.setattr(profiler, "measure", fake_measure)
    vector = AcceptanceVector((0.6, 0.1, 0.05))
    monkeypatch.setattr(measure, "vectors_for", lambda engine, progress: {0.0: (vector, tmp_path / "v0.json"),
                                                                          0.6: (vector, tmp_path / "v6.json")})
    return loaded


def test_the_fastest_predicted_candidate_is_loaded_and_decodes_exactly(folders, fakes):
    target, small = folders
    result, engine = greedy_past_eos(target, "Hello", 24, draft="auto", offload="disk")
    choice = engine.draft_choice
    names = [c.name for c in choice.candidates]
    # the self-drafts, the small model beside the target (not its equal-sized twin), suffix, none
    assert names == ["self-q8", "self-q4", "self-int8", "self-int4", str(small), "suffix", "none"]
    assert choice.chosen == "self-q4" and engine.draft_key.startswith("self-q4")
    by = {c.name: c for c in choice.candidates}
    # the predictions order as the level times do (same pass, same vector)
    order = sorted((n for n in LEVEL_S), key=LEVEL_S.get)
    assert sorted(order, key=lambda n: by[n].score(None)) == order
    assert by[str(small)].score(None) > by["self-int8"].score(None)
    assert by["suffix"].dropped and not by["none"].dropped
    assert by["none"].score(None) == pytest.approx(PASS_S, rel=0.01)  # plain decoding: a pass a token
    assert "draft auto: self-q4, tree (" in choice.summary(0.0) and "| **chosen** |" in choice.table()
    assert result.token_ids == greedy_past_eos(target, "Hello", 24)[0].token_ids


def test_the_table_is_cached_while_its_profiles_are(folders, fakes, monkeypatch):
    target, _ = folders
    from offload_engine import engine as engine_module
    evaluated = []  # each candidate's plan, made when the candidates are evaluated
    plan_only = engine_module.plan_only
    monkeypatch.setattr(engine_module, "plan_only", lambda *a, **k: evaluated.append(k["draft"]) or plan_only(*a, **k))
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    first = len(fakes)
    assert first >= 5 and len(evaluated) == 5  # every candidate planned and profiled once
    again = Engine.load(target, draft="auto", offload="disk", progress=False)
    again.close()
    assert len(fakes) == first and len(evaluated) == 5  # nothing evaluated again
    assert again.draft_choice.chosen == "self-q4"
    cached = draft_choice.choice_path(again.folder, dict(device=None, dtype=None, max_context=None, offload="disk",
                                                         vram=None, ram=None, buffers=None, weights="auto",
                                                         draft_group_size=64, cache_slots=1, tree_budget=None,
                                                         tree_depth=None, verify_reads=False,
                                                         max_batch_tokens=1024, overlap="auto"), None)
    assert cached.exists()
    profile = Path(next(c.profile for c in again.draft_choice.candidates if c.name == "self-q4"))
    data = json.loads(profile.read_text())
    profile.write_text(json.dumps({**data, "measured_at": "later"}))  # measured again: the choice is made again
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 10 and len(fakes) == first  # (the profiles themselves are still cached)
    profile.unlink()  # a profile gone: made again, that profile measured again
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 15 and len(fakes) == first + 1
    cached.write_text("[1]")  # a damaged table: made again, no traceback
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 20
    # a new profile version: every profile under a new key, the old files left behind; the table
    # is made again (from profiles measured again), not trusted because the old files still read
    monkeypatch.setattr(profiler, "PROFILE_VERSION", profiler.PROFILE_VERSION + 1)
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 25


def test_a_candidate_the_budget_cannot_hold_is_dropped_with_the_planners_reason(folders, fakes, tmp_path):
    target, _ = folders
    from offload_engine.engine import plan_only
    plan, *_ = plan_only(target, device="cpu", draft="self-q4", offload="disk", vram=1 << 40)
    # room for self-q4's substitutes, not for self-int8's whole copy and its cache
    vram = sum(plan.fixed_bytes.values()) + 4096
    from offload_engine.engine import choose_draft
    choice = choose_draft(target, dict(offload="disk", vram=vram), progress=False)
    by = {c.name: c for c in choice.candidates}
    assert "too small" in by["self-int8"].dropped and by["self-int8"].score(None) == float("inf")
    assert not by["self-q4"].dropped and choice.chosen == "self-q4"


def test_when_no_draft_pays_none_is_chosen(folders, fakes, monkeypatch):
    target, _ = folders
    monkeypatch.setitem(LEVEL_S, "self-q4", 5.0)
    for name in ("self-q8", "self-int8", "self-int4"):
        monkeypatch.setitem(LEVEL_S, name, 5.0)
    monkeypatch.setattr(__import__("test_draft_choice"), "SIBLING_LEVEL_S", 5.0)
    result, engine = greedy_past_eos(target, "Hello", 12, draft="auto", offload="disk")
    assert engine.draft_choice.chosen == "none" and engine.draft is None
    assert engine.draft_choice.summary(0.0).startswith("draft auto: none")


def test_plan_draft_auto_prints_the_table_and_named_candidates_join(folders, fakes, capsys):
    target, small = folders
    assert main(["plan", "--target", str(target), "--device", "cpu", "--offload", "disk", "--draft", "auto",
                 "--draft-candidates", f"{small},/nowhere/model"]) == 0
    out = capsys.readouterr().out
    assert "| self-q4 |" in out and "**chosen**" in out and "draft auto: self-q4" in out
    assert "| /nowhere/model | - | - | - | dropped: --draft /nowhere/model: not a checkpoint folder" in out
    assert out.count(f"| {small} |") == 1  # named and found beside the target: once
    assert main(["plan", "--target", str(target), "--device", "cpu", "--offload", "disk", "--draft", "auto",
                 "--draft-candidates", f"{small},/nowhere/model", "--max-new-tokens", "17"]) == 0
    out = capsys.readouterr().out
    assert "T=0: tree, s/token (17 tokens)" in out and "for 17-token answers" in out


def test_plain_decoding_is_pooled_over_the_profiles_of_one_plan():
    """Two profiles taken minutes apart saw plain decoding at 0.10 and 0.15 s/token (the machine
    drifted, as the 2-vCPU one does): A predicts 0.09 s/token (1.11x over its own plain), B 0.10
    (1.5x over its own). By raw s/token A looks faster; on one scale (the plan's median plain,
    0.125) B is: 0.083 against A's 0.1125. `none` is that pooled plain; a candidate on another plan
    (more layers streamed) keeps its own plain and does not move the pool."""
    def cand(name, predicted, plain, plan):
        return draft_choice.Candidate(name, predicted={0.0: predicted}, plain={0.0: plain},
                                      plain_measured={0.0: plain}, trees={0.0: "(8,3)"}, plan=plan)
    cands = [cand("a", 0.09, 0.10, "p"), cand("b", 0.10, 0.15, "p"), cand("c", 0.15, 0.20, "q"),
             draft_choice.Candidate("none")]
    draft_choice.pool_plain(cands)
    a, b, c, none = cands
    assert a.predicted[0.0] == pytest.approx(0.1125) and b.predicted[0.0] == pytest.approx(0.125 / 1.5)
    assert a.plain[0.0] == b.plain[0.0] == pytest.approx(0.125) and a.plain_measured[0.0] == 0.10
    assert c.predicted[0.0] == pytest.approx(0.15) and c.plain[0.0] == 0.20
    assert none.predicted == {0.0: pytest.approx(0.125)} and none.trees == {0.0: "plain"}
    choice = draft_choice._pick(cands, 0.0)
    assert choice.chosen == "b" and choice.speedup(0.0) == pytest.approx(1.5)
    # the first line gives the chosen draft's s/token on its own profile's scale (as the loaded
    # engine's stats line does): 0.10, not the table's pooled 0.083
    assert choice.summary(0.0).startswith("draft auto: b, tree (8,3), 0.100 s/token predicted, 1.50x over plain")


def test_a_draft_is_named_as_given(folders, tmp_path, monkeypatch):
    """The first line of demo and chat names the draft as the user gave it (a folder by its name,
    a self-draft by its own, '+suffix' kept), not by its key (model:<fingerprint>)."""
    from offload_engine.apps.cli import _draft_line
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target, small = folders
    for draft, name in ((str(small), "small"), ("self-int8", "self-int8"), ("self-int8+suffix", "self-int8+suffix")):
        engine = Engine.load(target, draft=draft, tree="sequoia", tree_budget=8, tree_depth=3, progress=False)
        assert engine.draft_name == name
        assert _draft_line(engine, 0.0).startswith(f"draft: {name}, sequoia tree")
        engine.close()


def test_the_candidates_plain_times_are_pooled_when_chosen(folders, fakes, monkeypatch):
    """Profiles that saw plain decoding at different speeds (the fakes' target passes 0.40 to 0.60 s,
    one per candidate, as a drifting machine gives): in the table every candidate on the plan has
    one plain time, the median of theirs, and `none` is that median (the rescaling of each one's
    prediction: test_plain_decoding_is_pooled_over_the_profiles_of_one_plan)."""
    from dataclasses import replace
    import statistics
    target, _ = folders
    module = __import__("test_draft_choice")
    real = module._fake_profile
    pass_s = {"self-q8": 0.40, "self-q4": 0.60, "self-int8": 0.50, "self-int4": 0.45}

    def drifting(engine, level_s):
        key = str(engine.draft_key)
        prof = real(engine, level_s)
        p = next((v for name, v in pass_s.items() if key.startswith(name)), 0.55)
        return replace(prof, target_pass_s=tuple(p for _ in prof.target_tokens))
    monkeypatch.setattr(module, "_fake_profile", drifting)
    engine = Engine.load(target, draft="auto", offload="disk", progress=False)
    engine.close()
    measured = [c for c in engine.draft_choice.candidates if c.plain_measured]
    assert len(measured) == 5 and len({c.plan for c in measured}) == 1
    for t in (0.0, 0.6):
        own = [c.plain_measured[t] for c in measured]
        assert max(own) > 1.3 * min(own)  # the drift the profiles saw
        pooled = statistics.median(own)
        for c in measured:
            assert c.plain[t] == pytest.approx(pooled)
        none = next(c for c in engine.draft_choice.candidates if c.name == "none")
        assert none.predicted[t] == pytest.approx(pooled)


def test_the_choice_is_for_the_answers_length():
    """A deep-tree draft that wins long generations (0.08 s/token) loses 16-token ones to a
    shallow one (0.14 against 0.10: its last step throws away what it accepted past the end),
    and 4-token ones to plain decoding; between two of LENGTHS the prediction is linear in
    1/length, past the longest it runs to the long-generation value."""
    def cand(name, long, by_length, tree):
        return draft_choice.Candidate(name, predicted={0.0: long}, plain={0.0: 0.12}, plain_measured={0.0: 0.12},
                                      trees={0.0: tree}, by_length={0.0: by_length}, plan="p")
    deep = cand("deep", 0.08, {4: [0.3, "(64,12)"], 16: [0.14, "(64,12)"], 32: [0.11, "(64,12)"],
                               1024: [0.081, "(64,12)"]}, "(64,12)")
    shallow = cand("shallow", 0.09, {4: [0.125, "(8,3)"], 16: [0.10, "(8,3)"], 32: [0.095, "(8,3)"],
                                     1024: [0.0901, "(8,3)"]}, "(8,3)")
    cands = [deep, shallow, draft_choice.Candidate("none")]
    draft_choice.pool_plain(cands)
    assert [draft_choice._pick(cands, 0.0, n).chosen for n in (None, 2048, 16, 4)] == ["deep", "deep", "shallow",
                                                                                       "none"]
    w = (1 / 16 - 1 / 24) / (1 / 16 - 1 / 32)
    assert deep.at(0.0, 24)[0] == pytest.approx(0.14 + w * (0.11 - 0.14))
    assert deep.at(0.0, 2048)[0] == pytest.approx(0.081 + 0.5 * (0.08 - 0.081))  # 1/2048 halfway to 0
    assert deep.at(0.0, 2)[0] == 0.3 and deep.at(0.0, None)[0] == 0.08
    choice = draft_choice._pick(cands, 0.0, 16)
    assert "for 16-token answers" in choice.summary(0.0) and "(16 tokens)" in choice.table()
    assert choice.speedup(0.0) == pytest.approx(0.12 / 0.10)


def test_a_short_answer_length_is_carried_to_the_table_and_the_tree(folders, fakes):
    """Engine.load(draft="auto", plan_tokens=N): the table (cached once for every length) is
    read for N-token answers, the loaded engine's --tree auto choice is made for the N - 1 tokens
    its steps make (the first comes from the prefill), and a later load for another length
    re-uses the cached table (no candidate evaluated again)."""
    target, _ = folders
    engine = Engine.load(target, draft="auto", offload="disk", progress=False, plan_tokens=9)
    engine.close()
    evaluated = list(fakes)
    choice = engine.draft_choice
    assert choice.length == 9 and all(p.length == 8 for p in engine.auto_plans.values())
    best = choice.best
    assert set(best.by_length[0.0]) == set(draft_choice.LENGTHS)
    plan = engine.auto_plans[0.0]
    assert plan.choice.length == 8 and plan.choice.tokens_per_step <= plan.choice.tree_tokens
    long = plan.for_length(None).choice
    assert plan.choice.seconds_per_token >= long.seconds_per_token  # (a short answer wastes its last step's tail)
    again = Engine.load(target, draft="auto", offload="disk", progress=False, plan_tokens=1000)
    again.close()
    assert list(fakes) == evaluated and again.draft_choice.length == 1000
    # the cached table reads as the fresh one did (its lengths' keys back from JSON strings)
    assert any(c.by_length for c in choice.candidates)
    for fresh, cached in zip(choice.candidates, again.draft_choice.candidates):
        for n in (9, 100, 1000, None):
            for t in fresh.predicted:
                (s1, tree1), (s2, tree2) = fresh.at(t, n), cached.at(t, n)
                assert s2 == pytest.approx(s1) and tree2 == tree1, (fresh.name, t, n)


def test_the_table_is_chosen_again_when_a_pairs_acceptance_vectors_change(folders, fakes, monkeypatch):
    """The table's predictions rest on each pair's acceptance vectors as much as on its profile: a
    vector re-measured (a pull of the repo's stored ones, the quick measurement's cache) re-chooses;
    the same bytes do not."""
    target, _ = folders
    from offload_engine import engine as engine_module
    from offload_engine.speculation.acceptance_store import MEASUREMENT, acceptance_cache_dir
    evaluated = []
    plan_only = engine_module.plan_only
    monkeypatch.setattr(engine_module, "plan_only", lambda *a, **k: evaluated.append(k["draft"]) or plan_only(*a, **k))
    first = Engine.load(target, draft="auto", offload="disk", progress=False)
    first.close()
    assert len(evaluated) == 5
    q4 = next(c for c in first.draft_choice.candidates if c.name == "self-q4")
    assert q4.pair == [first.target_fingerprint, first.draft_key]
    cache = acceptance_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    record = {"acceptance": [0.6, 0.1], "temperature": 0.0, "target_fingerprint": q4.pair[0],
              "draft_key": q4.pair[1], "measurement": MEASUREMENT}
    (cache / "q4__t0.json").write_text(json.dumps(record))  # a vector the table was not planned from
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 10
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 10  # the same bytes: trusted
    (cache / "q4__t0.json").write_text(json.dumps({**record, "acceptance": [0.7, 0.1]}))  # measured again
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 15
    (cache / "q4__t0.json").write_text(json.dumps({**record, "measurement": MEASUREMENT - 1}))  # not used: gone
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    assert len(evaluated) == 20


def test_vector_digests_name_the_files_not_their_folder(tmp_path, monkeypatch):
    """Two checkouts (or a moved one) with the same vectors share one cache: the same digests, so
    neither throws the other's table out; other bytes, other digests."""
    from offload_engine.speculation import acceptance_store as store
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    record = {"acceptance": [0.9, 0.1], "temperature": 0.0, "target_fingerprint": "fp", "draft_key": "d"}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "v__t0.json").write_text(json.dumps(record if name != "c" else {**record, "acceptance": [0.8]}))
    digests = []
    for name in ("a", "b", "c"):
        monkeypatch.setattr(store, "STORE_DIR", tmp_path / name)
        digests.append(draft_choice.vector_digests("fp", "d"))
    assert digests[0] and digests[0] == digests[1] and digests[2] != digests[0]


def test_a_cached_tables_chosen_draft_says_what_its_loaded_engine_predicts(folders, fakes):
    """A cached table's figures are from when it was chosen; the chosen draft's engine predicts
    again when it loads (its profile speed-checked, `profiler.speed_now`). `DraftChoice.refresh`
    puts the engine's figures in the chosen candidate, on the table's pooled scale, so that the
    first line (`summary`) and the engine's stats line say the same."""
    target, _ = folders
    Engine.load(target, draft="auto", offload="disk", progress=False).close()
    path = next((Path(os.environ["XDG_CACHE_HOME"]) / "sequoia-offload" / "draft-choice").glob("*.json"))
    data = json.loads(path.read_text())
    for c in data["candidates"]:  # the table as another spell of the machine left it (still chosen)
        if c["name"] == data["chosen"]:
            c["predicted"] = {t: v / 2 for t, v in c["predicted"].items()}
    path.write_text(json.dumps(data))
    engine = Engine.load(target, draft="auto", offload="disk", progress=False)
    engine.close()
    choice, plan = engine.draft_choice, engine.auto_plans[0.0]
    best = choice.best
    assert choice.chosen == data["chosen"]
    own = best.score(0.0) * best.plain_measured[0.0] / best.plain[0.0]
    assert own == pytest.approx(plan.for_length(None).choice.seconds_per_token)
    assert f"{plan.choice.seconds_per_token:.3f} s/token predicted" in choice.summary(0.0)
    assert choice.speedup(0.0) == pytest.approx(plan.predicted_speedup, rel=1e-6)


def _faster(c, factor: float) -> None:
    """Make candidate `c`'s table predictions `factor` times faster (its speed-up over plain too)."""
    for t in c.predicted:
        c.predicted[t] /= factor
        for entry in c.by_length.get(t, {}).values():
            entry[0] /= factor


def test_switch_target_weighs_what_the_run_measured_against_the_table_with_a_margin():
    """`switch_target`: the best other candidate on the same plan, when its speed-up is
    SWITCH_MARGIN above the loaded draft's measured one (at least plain's 1.0), once the loaded
    draft has decoded SWITCH_MIN_STEPS steps; a candidate used before counts with what it learned."""
    def cand(name, s_token, plan="p"):
        return draft_choice.Candidate(name, predicted={0.0: s_token}, plain={0.0: 1.0}, plain_measured={0.0: 1.0},
                                      trees={0.0: "(8,4)"}, plan=plan)
    choice = draft_choice.DraftChoice([cand("a", 0.5), cand("b", 0.4), cand("c", 0.2, plan="other"),
                                       draft_choice.Candidate("none", predicted={0.0: 1.0}, plain={0.0: 1.0}),
                                       draft_choice.Candidate("suffix", dropped="no")], "a", 0.0)
    enough, m = draft_choice.SWITCH_MIN_STEPS, draft_choice.SWITCH_MARGIN
    # b is predicted 2.5x, a measured 2.0x here: 2.5 is over 2.0 * (1 + SWITCH_MARGIN) = 2.3, so b;
    # a measured just over 2.5 / 1.15: within the margin, so none
    assert draft_choice.switch_target(choice, "a", 2.0, 0.0, None, enough, {}) == ("b", pytest.approx(2.5))
    assert draft_choice.switch_target(choice, "a", 2.5 / (1 + m) + 1e-6, 0.0, None, enough, {}) is None
    assert draft_choice.switch_target(choice, "a", 1.0, 0.0, None, enough - 1, {}) is None  # (too soon)
    # c is on another target plan (it would not fit where a is): never, however fast
    assert draft_choice.switch_target(choice, "b", 1.0, 0.0, None, enough, {"a": 0.9}) is None
    # b measured 1.1x when this run used it: that, not the table's 2.5x, is what it counts with
    assert draft_choice.switch_target(choice, "a", 1.0, 0.0, None, enough, {"b": 1.1}) is None
    # a draft that measures under plain: plain's 1.0 is its floor (its planner decodes plainly)
    assert draft_choice.switch_target(choice, "a", 0.5, 0.0, None, enough, {"b": 1.1}) is None


def test_a_draft_another_candidate_beats_here_is_replaced_between_answers_exactly(folders, fakes, monkeypatch):
    """--draft auto, adapting: after an answer, when the table predicts another candidate (on the
    same plan) well above what the loaded draft's planner learned it makes, that draft replaces it
    before the next answer: the old model and its K/V go, its plans and planners are kept (a switch
    back goes on from them), and every answer's greedy tokens are plain decoding's."""
    target, _ = folders
    plain = greedy_past_eos(target, "Hello", 24)[0].token_ids
    monkeypatch.setattr(draft_choice, "SWITCH_MIN_STEPS", 10**6)  # (no switch after the first answer)
    with Engine.load(target, draft="auto", offload="disk", progress=False) as engine:
        engine.eos_token_ids = frozenset()
        choice = engine.draft_choice
        assert choice.chosen == "self-q4"
        by = {c.name: c for c in choice.candidates}
        assert by["self-int8"].plan == by["self-q4"].plan  # (one disk plan: any of them fits)
        first = engine.generate("Hello", max_new_tokens=24)
        assert first.token_ids == plain and first.stats["draft_switch"] is None
        old_model, old_planner = weakref.ref(engine.draft), engine.planners[0.0]
        monkeypatch.setattr(draft_choice, "SWITCH_MIN_STEPS", 1)
        _faster(by["self-int8"], 100.0)  # the table now promises self-int8 far more than any run measures
        build, freed = engine._build_draft, []

        def watched(name):  # (the old draft's memory is back before the new one is built: the
            freed.append(old_model() is None)  # answer's decoder, caches and levels let it go)
            return build(name)
        monkeypatch.setattr(engine, "_build_draft", watched)
        second = engine.generate("Hello", max_new_tokens=24)
        assert freed == [True]
        assert second.token_ids == plain
        switch = second.stats["draft_switch"]
        assert switch["from"] == "self-q4" and switch["to"] == "self-int8" and "is predicted" in switch["why"]
        assert engine.draft is not None and engine.draft_key.startswith("self-int8")
        assert engine.draft_name == "self-int8" and choice.chosen == "self-int8" and engine.draft_switches == [switch]
        assert engine.planners == {} and engine.auto_plans[0.0].source  # (its own plans, planners made on use)
        assert engine.draft_states["self-q4"]["planners"][0.0] is old_planner
        monkeypatch.setattr(draft_choice, "SWITCH_MIN_STEPS", 10**6)
        third = engine.generate("Hello", max_new_tokens=24)  # on self-int8, with a K/V cache of its own
        assert third.token_ids == plain and engine.draft_key.startswith("self-int8")
        assert third.stats["draft_switch"] is None
        int8 = engine.draft
        slots = engine.prefix_cache._slots[engine.prefix_cache.current]
        assert int8 in slots
        # and back: self-q4's planner, kept, says it makes 50x here (what it learned is what counts),
        # once self-int8 has decoded twice SWITCH_MIN_STEPS (one switch made: `switch_wait`)
        monkeypatch.setattr(draft_choice, "SWITCH_MIN_STEPS", 100)
        monkeypatch.setattr(draft_choice, "adapted_speedup",
                            lambda planner, length: 1.0 if planner is engine.planners.get(0.0) else 50.0)
        engine.steps_with_draft = 150  # (past 100: without the wait doubled, it would switch now)
        assert engine._consider_switch(engine.planners[0.0], 0.0, 24) is None and engine.draft is int8
        engine.steps_with_draft = 199  # (the next answer's steps take it past 200)
        fourth = engine.generate("Hello", max_new_tokens=24)
        assert fourth.token_ids == plain and fourth.stats["draft_switch"]["to"] == "self-q4"
        assert int8 not in slots and engine.model in slots  # (the replaced draft's K/V gone, the target's kept)
        assert "self-q4 measured" in fourth.stats["draft_switch"]["why"] and engine.planners[0.0] is old_planner
        assert "is predicted" not in fourth.stats["draft_switch"]["why"]
        assert engine.generate("Hello", max_new_tokens=24).token_ids == plain


def test_a_switch_that_fails_keeps_the_old_draft_and_the_answers_go_on(folders, fakes, monkeypatch, capsys):
    """A draft switch that cannot be made (the new draft out of memory as it is built, its plans
    unreadable) puts the old draft back as it was, planners included, and says so on one line;
    if even the old one cannot be built again, the engine decodes plainly from then on. No answer
    is lost and every one is plain decoding's greedy tokens."""
    target, _ = folders
    plain = greedy_past_eos(target, "Hello", 24)[0].token_ids
    monkeypatch.setattr(draft_choice, "SWITCH_MIN_STEPS", 10**6)
    with Engine.load(target, draft="auto", offload="disk", progress=False) as engine:
        engine.eos_token_ids = frozenset()
        choice = engine.draft_choice
        by = {c.name: c for c in choice.candidates}
        assert engine.generate("Hello", max_new_tokens=24).token_ids == plain
        old_planner = engine.planners[0.0]
        build, plan_auto = engine._build_draft, engine._plan_auto
        monkeypatch.setattr(draft_choice, "SWITCH_MIN_STEPS", 1)
        _faster(by["self-int8"], 100.0)
        for c in choice.candidates:  # (the others far behind: self-int8 is the only one to switch to)
            if c.name not in ("self-q4", "self-int8"):
                _faster(c, 1e-3)
        for broken in ("build", "plan"):
            def failing_build(name):
                if name == "self-int8" and broken == "build":
                    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
                return build(name)

            def failing_plan(*a, **k):
                raise OSError("profile unreadable")
            monkeypatch.setattr(engine, "_build_draft", failing_build)
            monkeypatch.setattr(engine, "_plan_auto", failing_plan if broken == "plan" else plan_auto)
            answer = engine.generate("Hello", max_new_tokens=24)
            assert answer.token_ids == plain and answer.stats["draft_switch"] is None, broken
            err = capsys.readouterr().err
            assert "cannot switch the draft to self-int8" in err and "keeping self-q4" in err, (broken, err)
            assert ("out of memory" if broken == "build" else "profile unreadable") in err
            assert choice.chosen == "self-q4" and engine.draft_name == "self-q4" and engine.draft is not None
            assert engine.draft_key.startswith("self-q4") and engine.planners[0.0] is old_planner
            assert "self-q4" not in engine.draft_states and engine.draft_switches == []
            # on self-q4 still, and a switch that failed is not tried again (each try would free
            # and rebuild the loaded draft)
            assert engine.generate("Hello", max_new_tokens=24, seed=1).token_ids == plain
            assert "cannot switch" not in capsys.readouterr().err and engine.switch_failed == {"self-int8"}
            engine.switch_failed.clear()  # (for the next way of failing)

        # Ctrl-C while the new draft is built: the old one back, and the interrupt goes on up
        def interrupted(name):
            if name == "self-int8":
                raise KeyboardInterrupt
            return build(name)
        monkeypatch.setattr(engine, "_build_draft", interrupted)
        monkeypatch.setattr(engine, "_plan_auto", plan_auto)
        with pytest.raises(KeyboardInterrupt):
            engine.generate("Hello", max_new_tokens=24)
        assert choice.chosen == "self-q4" and engine.draft is not None and engine.planners[0.0] is old_planner
        assert engine.generate("Hello", max_new_tokens=24).token_ids == plain
        engine.switch_failed.clear()
        capsys.readouterr()

        def broken_outlook(planner, length):
            raise ValueError("a table that cannot be filled")
        with monkeypatch.context() as m:  # (a failure before any switch: the answer is kept, one line)
            m.setattr(draft_choice, "adapted_speedup", broken_outlook)
            answer = engine.generate("Hello", max_new_tokens=24)
        assert answer.token_ids == plain and answer.stats["draft_switch"] is None
        assert "no switch (ValueError: a table that cannot be filled)" in capsys.readouterr().err

        def nothing_builds(name):
            raise RuntimeError("CUDA out of memory")
        monkeypatch.setattr(engine, "_build_draft", nothing_builds)
        monkeypatch.setattr(engine, "_plan_auto", plan_auto)
        answer = engine.generate("Hello", max_new_tokens=24)
        assert answer.token_ids == plain and answer.stats["draft_switch"] is None
        assert "going on without a draft" in capsys.readouterr().err
        assert engine.draft is None and choice.chosen == "none"
        after = engine.generate("Hello", max_new_tokens=24)
        assert after.token_ids == plain and after.stats["tree"] == "none" and after.stats["target_steps"] == 23
