"""Substitute self-drafts (`--draft self-q8` / `self-q4`, SubSpec) and the next tree grown while the
target streams (ShadowSpec): the draft runs the target's own resident layers and a quantised
copy of each streamed one, on the target's KV cache; the plan counts the substitutes; greedy
output is plain greedy for every tree kind, with and without the trees grown ahead; after every
step the shared cache holds exactly the target's K/V of the committed text; and a tree grown
ahead is the tree the next step would have grown. (The sampled distribution with a shared cache
and trees grown ahead: tests/test_speculative_distribution.py.)"""


import pytest
import torch

from offload_engine import Engine
from offload_engine.engine import plan_only
from offload_engine.formats.config import load_config
from offload_engine.runtime.quant import QuantizedLinear
from offload_engine.speculation import decoder as decoder_module
from offload_engine.speculation.decoder import SpeculativeDecoder
from offload_engine.speculation.drafts import head_bytes, substitute_layer_bytes
from sequoia_trees.sampling import SamplingParams
from tiny_models import greedy_past_eos, make_tiny_checkpoint, slow_fills

PROMPT = "The capital of France is"
LAYERS = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("subdraft") / "t", "llama3-gqa", layers=LAYERS, seed=3,
                                init_std=0.05)


@pytest.fixture
def slow_disk(monkeypatch):
    """Every layer fill takes 10 ms more, so that a pass waits for its layers (a tiny model's
    layers otherwise arrive before they are wanted, and nothing is grown ahead)."""
    slow_fills(monkeypatch, 0.01)


def _budget_for(target, resident: int) -> int:
    """A --vram budget with room for `resident` dense layers and a substitute for each other one."""
    cfg = load_config(target)
    sub = substitute_layer_bytes(cfg, torch.float32, "int4", 32)
    whole, *_ = plan_only(target, device="cpu", draft="self-q4", draft_group_size=32, offload="auto", vram=1 << 40)
    assert whole.resident_layers == tuple(range(LAYERS))  # everything fits: no substitute at all
    assert not any("substitutes" in k for k in whole.fixed_bytes)
    streamed, *_ = plan_only(target, device="cpu", draft="self-q4", draft_group_size=32, offload="disk",
                             vram=1 << 40, buffers=1)
    rest = sum(streamed.fixed_bytes.values()) - LAYERS * sub  # buffers, caches, embeddings...
    return rest + resident * streamed.dense_layer_bytes + (LAYERS - resident) * sub + 1024


def test_the_plan_counts_a_substitute_per_streamed_layer_and_no_draft_cache(target):
    cfg = load_config(target)
    sub = substitute_layer_bytes(cfg, torch.float32, "int4", 32)
    for resident in (0, 3, 5):
        plan, *_ = plan_only(target, device="cpu", draft="self-q4", draft_group_size=32, offload="auto",
                             vram=_budget_for(target, resident), buffers=1)
        streamed = LAYERS - len(plan.resident_layers)
        assert plan.fixed_bytes[f"draft substitutes ({streamed} streamed layers)"] == streamed * sub
        assert not any("draft kv" in k for k in plan.fixed_bytes), plan.fixed_bytes
        assert plan.fixed_bytes.get("draft") == head_bytes(cfg, "cpu")  # (its int8 head, on the CPU)
        assert plan.vram_bytes <= plan.vram_budget_bytes
        # each resident layer pays its bytes and saves its substitute: one more would not fit
        assert len(plan.resident_layers) == resident
    full, *_ = plan_only(target, device="cpu", draft="self-int4", draft_group_size=32, offload="disk")
    assert full.fixed_bytes["draft"] == LAYERS * sub + head_bytes(cfg, "cpu") and "draft kv cache" in full.fixed_bytes


def test_the_substitute_draft_runs_the_targets_resident_layers(target, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = Engine.load(target, draft="self-q4", draft_group_size=32, offload="auto",
                         vram=_budget_for(target, 3), buffers=1, tree="sequoia", tree_budget=8, tree_depth=3,
                         progress=False)
    try:
        resident = engine.plan.resident_layers
        assert 0 < len(resident) < LAYERS
        for i, layer in enumerate(engine.draft.layers):
            if i in resident:
                assert layer is engine.model.layers.resident[i]  # the same tensors, not a copy
            else:
                assert all(isinstance(w, QuantizedLinear) for n, w in layer.items() if n.endswith("proj.weight"))
        assert engine.draft.shares_cache and not engine.model.shares_cache
        assert engine.overlap  # on by default for the substitute drafts
    finally:
        engine.close()
    # (the tree as above: the default, --tree auto, would first measure the pair's vectors and a
    # machine profile, 6 s of this test, for a plan that nothing here looks at)
    whole = Engine.load(target, draft="self-q4", draft_group_size=32, offload="none", tree="sequoia", tree_budget=8,
                        tree_depth=3, progress=False)
    try:  # nothing streams: the draft is the target itself, and there is no wait to grow into
        assert all(a is b for a, b in zip(whole.draft.layers, (whole.model.layers.resident[i] for i in range(LAYERS))))
        assert not whole.overlap
    finally:
        whole.close()


@pytest.fixture(scope="module")
def plain(target):
    return greedy_past_eos(target, PROMPT, 40)[0].token_ids


@pytest.mark.parametrize("kind,budget,depth", [("sequoia", 24, 6), ("specexec", 16, 5), ("chain", 1, 5)])
@pytest.mark.parametrize("draft", ["self-q8", "self-q4"])
def test_greedy_with_a_substitute_draft_equals_plain_greedy(target, plain, tmp_path, monkeypatch, slow_disk, draft,
                                                            kind, budget, depth):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = plain
    for overlap in ("on", "off", "auto"):  # (auto: growing as its gate says, `tests/test_overlap_gate.py`)
        result, _ = greedy_past_eos(target, PROMPT, 40, tree=kind, draft=draft, draft_group_size=32, offload="disk",
                                    buffers=2, tree_budget=budget, tree_depth=depth, overlap=overlap)
        assert result.token_ids == want, (overlap, kind)
        assert result.stats["tokens_per_step"] > 1.5
        stats = result.stats["overlap"]
        if overlap == "on" and kind != "specexec":  # (best-first trees are not grown ahead)
            # trees grown during the pass, some of them the next step's (measured: 2-7 of 7-10 steps)
            assert stats["hits"] >= 1 and stats["levels_used"] >= 1, stats
            assert result.stats["step_split"]["draft_overlapped"] > 0
        elif overlap == "off" or kind == "specexec":
            assert stats is None or stats["hits"] == stats["misses"] == 0


def test_a_choice_of_cases_still_on_its_way_to_the_host_is_waited_for(target, plain, tmp_path, monkeypatch, slow_disk):
    """The cases grown ahead are chosen on the device and copied to the host without a wait (on
    CUDA: behind the draft's last level, `decoder._to_host`); the units run in the pass's waits
    ask whether the copy has landed and do nothing until it has. Here every choice answers "not
    yet" three times first: the trees are still grown and used, and the output is plain greedy's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real, asked = decoder_module._to_host, []

    def late(t):
        host, _ = real(t)
        calls = iter([False, False, False])
        return host, lambda: asked.append(1) is None and next(calls, True)
    monkeypatch.setattr(decoder_module, "_to_host", late)
    result, _ = greedy_past_eos(target, PROMPT, 40, tree="sequoia", draft="self-q8", draft_group_size=32,
                                offload="disk", buffers=2, tree_budget=24, tree_depth=6, overlap="on")
    assert result.token_ids == plain
    stats = result.stats["overlap"]
    assert stats["hits"] >= 1 and stats["levels_used"] >= 1, stats
    assert len(asked) >= 4 * (stats["hits"] + stats["misses"])  # (three "not yet" and a "now" per step)


def _committed_kv_matches_target(engine, dec, seq):
    fresh = engine.model.new_cache(len(seq))
    engine.model.forward(torch.tensor(seq), torch.arange(len(seq)), fresh)
    n = len(seq)
    # (float32 sums in another order: noise ~1e-5; the substitute's K/V differ from the target's by O(0.1))
    torch.testing.assert_close(dec.target_cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(dec.target_cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_shared_cache_holds_the_targets_kv_after_every_step(target, tmp_path, monkeypatch, temperature):
    """The draft writes its tree's K/V into the target's cache; the target's pass writes its own
    over the same slots and only the accepted path is committed: after each step the committed
    slots are exactly what a target-only prefill of the committed text gives."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = Engine.load(target, draft="self-q4", draft_group_size=32, offload="disk", tree="sequoia",
                         tree_budget=16, tree_depth=5, progress=False)
    try:
        ids = engine.tokenizer.encode(PROMPT)
        dec = SpeculativeDecoder(engine.model, engine.draft, engine.tree, SamplingParams(temperature),
                                 torch.Generator().manual_seed(0), 256, overlap="eager")
        assert dec.draft_cache.k is dec.target_cache.k and len(dec.seqs) == 1  # one cache, two lengths
        root = dec.first_token(dec.prefill(ids, 1024))
        seq, accepted = list(ids), 0
        for _ in range(10):
            step = dec.step(root)
            seq += [root] + step.tokens[:-1]
            root = step.tokens[-1]
            accepted += len(step.verify.accepted)
            assert dec.target_cache.length == len(seq) == len(dec.seqs[0].tokens)
            _committed_kv_matches_target(engine, dec, seq)
        assert accepted >= 10  # the tree's nodes were committed, not only bonus tokens
        assert dec.ahead_hits + dec.ahead_misses == 10  # every step grew the next trees ahead
        if temperature == 0:  # (at 0.8 this tiny model's flat distributions rarely give the guessed bonus)
            assert dec.ahead_hits >= 1  # and some steps started from one
    finally:
        engine.close()


def test_a_tree_grown_ahead_is_the_tree_the_next_step_would_grow(target, tmp_path, monkeypatch):
    """Greedy, a draft with its own cache (so that growing ahead sees the K/V a fresh growth
    would): whenever a step starts from a tree grown ahead, that tree's tokens equal the ones a
    decoder without overlap grows at the same step, node for node."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = Engine.load(target, draft="self-int8", offload="none", tree="sequoia",
                         tree_budget=16, tree_depth=5, progress=False)
    try:
        ids = engine.tokenizer.encode(PROMPT)
        trees = {}
        for overlap in ("eager", False):
            dec = SpeculativeDecoder(engine.model, engine.draft, engine.tree, SamplingParams(0.0),
                                     torch.Generator().manual_seed(0), 256, overlap=overlap)
            grown = []
            verify = dec._verify
            dec._verify = lambda parents, tokens, *a, **k: (grown.append(tokens.tolist()),
                                                            verify(parents, tokens, *a, **k))[1]
            root = dec.first_token(dec.prefill(ids, 1024))
            used = []
            for _ in range(12):
                root = dec.step(root).tokens[-1]
                used.append(dec.last_times.ahead_levels)  # levels of this step's tree grown ahead
            trees[overlap] = list(zip(grown, used))
        ahead = [i for i, (_, used) in enumerate(trees["eager"]) if used]
        assert len(ahead) >= 3, trees["eager"]
        for i in ahead:
            assert trees["eager"][i][0] == trees[False][i][0], i
    finally:
        engine.close()


def test_the_profile_measures_the_pass_waits_and_the_overlap_used(target, tmp_path, monkeypatch):
    """`profile` on a substitute draft whose passes wait for a slowed disk: each target width gets
    its waits (every pass waits: 25 ms a layer), the real steps run in pairs of one shape so
    that the second can start from a tree the first grew ahead, and the share used is above 0
    (greedy: the int4 copy of the same weights agrees with the target, so the likeliest cases
    come) and at most 1. The step model then predicts less draft time before each pass."""
    from offload_engine.planning import profiler
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    slow_fills(monkeypatch, 0.025)  # 25 ms a layer: the passes wait whatever else the machine runs
    engine = Engine.load(target, draft="self-q4", draft_group_size=32, offload="disk", buffers=2, tree="sequoia",
                         tree_budget=8, tree_depth=3, max_batch_tokens=64, progress=False)
    try:
        assert engine.overlap
        prof = profiler.measure(engine, budget_s=8, progress=False)
    finally:
        engine.close()
    assert len(prof.target_idle_s) == len(prof.target_tokens)
    assert all(0 < w <= t for w, t in zip(prof.target_idle_s, prof.target_pass_s)), prof.target_idle_s
    assert prof.target_idle_s[0] > 0.03  # 6 of the 8 layers' waits, up to 25 ms each
    assert 0 < prof.overlap_use_greedy <= 1 and 0 <= prof.overlap_use <= 1
    t = prof.timings(greedy=True)
    work = t.draft_factor * sum(t.draft(w) for w in (1, 2, 4, 4))
    assert t.overlapped(16, work) > 0


def test_another_substitute_draft_on_the_same_cache_gets_levels_of_its_own(target, plain, tmp_path, monkeypatch):
    """A substitute draft's padded level passes (`StaticLevels`, CUDA graphs on a GPU) live on the
    target's cached sequence, since the draft shares its cache. When --draft auto replaces one
    substitute draft by another, the next decoder must not replay the first one's levels (its
    weights, its captured graphs): it makes its own, and `PrefixCache.drop` forgets the old ones."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with Engine.load(target, draft="self-q4", draft_group_size=32, offload="disk", buffers=2, tree="sequoia",
                     tree_budget=16, tree_depth=5, progress=False) as engine:
        ids = engine.prompt_ids(PROMPT)
        first, second = engine.draft, engine._build_draft("self-q8")[0]
        assert second.shares_cache and second is not first
        for draft in (first, second):
            engine.prefix_cache.select(engine.model, ids)
            dec = SpeculativeDecoder(engine.model, draft, engine.tree, SamplingParams(0.0), torch.Generator(),
                                     len(ids) + 40, engine.prefix_cache, draft_graphs="eager")
            out = [dec.first_token(dec.prefill(ids, engine.max_batch_tokens))]
            while len(out) < 20:
                out += dec.step(out[-1]).tokens
            assert out[:20] == plain[:20]
            assert dec.draft_levels.model is draft and dec.draft_levels.eager > 0
        seq = engine.prefix_cache.sequence(engine.model, len(ids) + 40)
        assert seq.levels.model is second
        engine.prefix_cache.drop(second)
        assert seq.levels is None and seq in engine.prefix_cache._slots[engine.prefix_cache.current].values()
