"""Engine.variant: decoding configurations over one loaded engine (what the auto study compares
modes on). Each variant decodes as an engine loaded with its configuration would: greedy output
equals plain decoding, the sampled output equals a separately loaded engine's for the same seed,
its tree and planners are its own, and closing it leaves the base engine working."""


import pytest

import offload_engine.planning.profiler as profiler
from offload_engine import Engine
from offload_engine.errors import UserError
from test_auto_tree import _fake_profile
from tiny_models import make_tiny_checkpoint, slow_fills


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("variant") / "t", "llama3-gqa", layers=2, seed=5,
                                init_std=0.05)


def _gen(engine, temperature=0.0, seed=0):
    engine.eos_token_ids = frozenset()
    return engine.generate("Hello there", max_new_tokens=20, temperature=temperature, seed=seed)


def test_variants_decode_as_their_own_engines_would(target, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", lambda engine, *a, **k: _fake_profile(engine))
    with Engine.load(target, draft="self-int8", tree="auto", offload="disk", progress=False) as base:
        with Engine.load(target, offload="disk", progress=False) as lone:
            plain_ids = _gen(lone).token_ids
            plain_sampled = _gen(lone, 0.6, seed=3).token_ids
        plain = base.variant(draft=False)
        fixed = base.variant(tree="sequoia", tree_budget=8, tree_depth=3)
        frozen = base.variant(adapt=False)
        r = _gen(plain)
        assert r.token_ids == plain_ids and r.stats["tree"] == "none" and r.stats["tokens_per_step"] == 1.0
        # plain sampling on the variant draws what a plain engine draws for the same seed
        assert _gen(plain, 0.6, seed=3).token_ids == plain_sampled
        r = _gen(fixed)
        assert r.token_ids == plain_ids and (r.stats["tree"], r.stats["tree_budget"]) == ("sequoia", 8)
        assert r.stats["tokens_per_step"] > 1.0  # the int8 copy of a tiny model agrees with it: the tree pays
        r = _gen(frozen)
        assert r.token_ids == plain_ids and r.stats["auto"]["adapt"] is False
        # planners are per variant: the base's stay untouched by its variants' generations
        other = base.variant()
        assert _gen(other).token_ids == plain_ids
        assert base.planners == {} and frozen.planners and other.planners
        assert not {id(p) for p in frozen.planners.values()} & {id(p) for p in other.planners.values()}
        assert other.planners[0.0].adapt is True and frozen.planners[0.0].adapt is False
        assert base.adapt is True and base.tree.kind == "sequoia" and base.draft is not None
        plain.close()  # a variant owns nothing: the base engine still decodes
        r = _gen(base)
        assert r.token_ids == plain_ids and r.stats["auto"]["adapt"] is True
        with pytest.raises(UserError, match="needs a draft"):
            plain.variant(tree="sequoia")
        with pytest.raises(UserError, match="at most"):
            base.variant(tree="sequoia", tree_budget=base.max_batch_tokens + 1, tree_depth=4)
        assert fixed.tree.depth == 3 and plain.draft is None


def test_an_engine_with_suffix_drafts_has_no_variants(target, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with Engine.load(target, draft="suffix", offload="disk", progress=False) as engine:
        with pytest.raises(UserError, match="suffix"):
            engine.variant(draft=False)


def test_variants_set_overlap_as_load_would(target, tmp_path, monkeypatch):
    """variant(overlap=...) over one loaded substitute self-draft (its target streamed): "on"
    grows the next tree in the passes' waits, "auto" asks a gate of its own, "off" grows nothing;
    greedy output equals plain decoding's in each; a bad value is refused by name."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target = make_tiny_checkpoint(tmp_path / "t6", "llama3-gqa", layers=6, seed=5, init_std=0.05)
    # (every layer waited for, so that the waits take draft work: two buffers, so that the loader
    # cannot hold the whole model ahead of the passes, and fills 20 ms slower. With the CPU's six
    # buffers and 3 ms, a CI run on 2026-12-07 and 1 of 2 local runs grew nothing, 0 hits + 0
    # misses, and under two busy loops 3 of 3; with these, 7 of 7 and 3 of 3)
    with Engine.load(target, offload="disk", progress=False) as lone:  # (the reference: no fill slowed)
        plain_ids = _gen(lone).token_ids
    slow_fills(monkeypatch, 0.02)
    with Engine.load(target, draft="self-q8", tree="sequoia", tree_budget=4, tree_depth=3, offload="disk",
                     buffers=2, overlap="off", progress=False) as base:
        # (every unit runs until its layer is in: the CPU's fit rule, which holds a unit back when
        # it is not counted on to end in time, held every one in a slow CI run and grew nothing;
        # it is tests/test_overlap_gate.py's business)
        base.model.layers.fit_units = False
        assert _gen(base).stats["overlap"] is None
        on, auto, off = (base.variant(overlap=m) for m in ("on", "auto", "off"))
        r = _gen(on)
        assert r.token_ids == plain_ids and r.stats["overlap"]["hits"] + r.stats["overlap"]["misses"] > 0
        assert "gate" not in r.stats["overlap"] and r.stats["idle_work_seconds"] > 0
        r = _gen(auto)
        assert r.token_ids == plain_ids and "gate" in r.stats["overlap"] and auto.overlap_gates
        assert not base.overlap_gates and not on.overlap_gates
        r = _gen(off)
        assert r.token_ids == plain_ids and r.stats["overlap"] is None and r.stats["idle_work_seconds"] == 0
        with pytest.raises(UserError, match="overlap must be"):
            base.variant(overlap="sometimes")
