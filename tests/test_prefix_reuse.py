"""Prefix reuse: the next turn of a conversation prefills only its new tokens (counted at the
target's forward), with the same output as a fresh prefill, plain and speculative, resident and
streamed; a cancelled generation leaves the cache usable."""

import threading

import pytest

from offload_engine import Engine
from offload_engine.errors import GenerationCancelled
from offload_engine.speculative import common_prefix
from tiny_models import make_tiny_checkpoint

TURNS = ["What is the capital of France?", "And of Italy?", "Say hello to the world."]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    target = make_tiny_checkpoint(root / "target", "llama3-gqa", layers=3, init_std=0.3, seed=1)
    draft = make_tiny_checkpoint(root / "draft", "llama3-gqa", layers=1, hidden=32, heads=2, intermediate=64,
                                 init_std=0.3, seed=2)
    return target, draft


def _load(folder, **kw):
    engine = Engine.load(folder, progress=False, **kw)
    engine.eos_token_ids = frozenset()  # fixed-length answers, so that runs compare token for token
    return engine


def _conversation(engine, max_new=12, fresh_each_turn=False, on_turn=None, **gen):
    """Three turns through the chat template; per turn (prompt ids, cached tokens before, result).
    on_turn(prompt ids, cached tokens before, result) is called after each turn."""
    history, turns = [], []
    for question in TURNS:
        history.append({"role": "user", "content": question})
        if fresh_each_turn:
            engine.forget_prefix()
        before = engine.prefix_cache.tokens(engine.model)
        ids = engine.prompt_ids(messages=history)
        result = engine.generate(messages=history, max_new_tokens=max_new, **gen)
        turns.append((ids, before, result))
        if on_turn is not None:
            on_turn(ids, before, result)
        history.append({"role": "assistant", "content": result.text})
    return turns


@pytest.mark.parametrize("offload", ["none", "disk"])
def test_later_turns_prefill_only_new_tokens_counted_at_the_target(pair, offload):
    engine = _load(pair[0], offload=offload)
    seen: list[int] = []
    real = engine.model.forward

    def counting(input_ids, *a, **kw):
        seen.append(int(input_ids.shape[0]))
        return real(input_ids, *a, **kw)

    previous: list[list[int]] = []

    def check(ids, before, result):
        s = result.stats
        expected_reuse = min(common_prefix(before, ids), len(ids) - 1)
        assert s["cached_prompt_tokens"] == expected_reuse
        assert s["prefilled_tokens"] == len(ids) - expected_reuse
        # every token the target ran: the prefilled ones, then one per plain decoding step
        assert sum(seen) == s["prefilled_tokens"] + s["target_steps"]
        if previous:
            prev_ids, prev_answer = previous[-1]
            # the cache held the previous prompt and every answer token but the last (never fed)
            assert before[:len(prev_ids)] == prev_ids and before[len(prev_ids):] == prev_answer[:-1]
            assert expected_reuse >= len(prev_ids)  # the whole previous prompt at least
            # (the random model's answers are not valid UTF-8, so their text re-encodes to other
            # tokens and reuse stops inside them; the slow default-model test checks real text)
        previous.append((ids, result.token_ids))
        seen.clear()

    engine.model.forward = counting
    try:
        _conversation(engine, on_turn=check)
        assert len(previous) == len(TURNS)
    finally:
        engine.close()


@pytest.mark.parametrize("draft,tree", [(None, None), ("draft", "sequoia"), ("target", "chain")])
def test_reuse_gives_the_same_tokens_as_a_fresh_prefill_and_as_plain_greedy(pair, tmp_path, monkeypatch, draft, tree):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target, draft_dir = pair
    kw = {} if draft is None else dict(draft=draft_dir if draft == "draft" else target, tree=tree, tree_budget=12,
                                       tree_depth=4)
    plain = _load(target)
    reusing = _load(target, **kw)
    try:
        fresh = _conversation(plain, fresh_each_turn=True)
        reused = _conversation(reusing)
        for (ids_a, _, a), (ids_b, _, b) in zip(fresh, reused):
            assert ids_a == ids_b and a.token_ids == b.token_ids
        assert all(r.stats["cached_prompt_tokens"] == 0 for _, _, r in fresh)
        assert all(r.stats["cached_prompt_tokens"] >= len(fresh[i][0]) for i, (_, _, r) in enumerate(reused[1:]))
        # a continuation given as token ids (the answer's own tokens, then more): everything the
        # cache holds is reused, the answer included, and decoding matches a fresh prefill
        ids, _, last = reused[-1]
        for turn in range(3):
            longer = ids + last.token_ids + plain.tokenizer.encode(" Paris is in France.")
            a = reusing.generate(input_ids=longer, max_new_tokens=12)
            assert a.stats["cached_prompt_tokens"] >= len(ids) + len(last.token_ids) - 1
            plain.forget_prefix()
            b = plain.generate(input_ids=longer, max_new_tokens=12)
            assert b.stats["cached_prompt_tokens"] == 0 and a.token_ids == b.token_ids
            if draft == "target":  # the draft's reused cache is right too: an identical draft is always accepted
                assert a.stats["tokens_per_step"] >= 3
            ids, last = longer, a
    finally:
        plain.close()
        reusing.close()


def test_sampled_generation_with_reuse_matches_a_fresh_prefill_under_the_same_seed(pair):
    engine = _load(pair[0])
    try:
        fresh = _conversation(engine, fresh_each_turn=True, temperature=0.8, seed=7)
        reused = _conversation(engine, temperature=0.8, seed=7)
        assert [r.token_ids for _, _, r in fresh] == [r.token_ids for _, _, r in reused]
        assert reused[2][2].stats["cached_prompt_tokens"] > 0
    finally:
        engine.close()


def test_a_cancelled_generation_stops_promptly_and_leaves_the_cache_usable(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target, draft = pair
    engine = _load(target, draft=draft, tree="sequoia", tree_budget=12, tree_depth=4, offload="disk")
    try:
        cancel = threading.Event()
        got = []

        def on_token(token_id, text):
            got.append(token_id)
            if len(got) == 5:
                cancel.set()

        with pytest.raises(GenerationCancelled):
            engine.generate("The capital of France is", max_new_tokens=200, on_token=on_token, cancel=cancel)
        assert 5 <= len(got) < 12  # the step in hand ends at its next layer: at most one more step's tokens
        assert engine.model.interrupt is None and engine.draft.interrupt is None
        # the cache kept a consistent prefix; the same prompt now reuses it and decodes as fresh
        again = engine.generate("The capital of France is", max_new_tokens=20)
        engine.forget_prefix()
        fresh = engine.generate("The capital of France is", max_new_tokens=20)
        assert again.stats["cached_prompt_tokens"] == fresh.stats["prompt_tokens"] - 1
        assert again.token_ids == fresh.token_ids
        # an event already set stops before any work
        cancel2 = threading.Event()
        cancel2.set()
        with pytest.raises(GenerationCancelled):
            engine.generate("Hello", max_new_tokens=5, cancel=cancel2)
    finally:
        engine.close()


def test_a_long_prompt_after_a_short_one_decodes_as_fresh(pair):
    engine = _load(pair[0], max_context=512)
    try:
        short = engine.generate("Hello", max_new_tokens=4)
        long_prompt = "Hello" + " The capital of France is Paris." * 25
        longer = engine.generate(long_prompt, max_new_tokens=4)
        assert longer.stats["cached_prompt_tokens"] >= 1 and short.stats["cached_prompt_tokens"] == 0
        # the cache is allocated once, at the size the plan reserves: the context plus the widest pass
        assert engine.prefix_cache.sequence(engine.model, 1).cache.capacity == 512 + engine.max_batch_tokens
        engine.forget_prefix()
        assert engine.generate(long_prompt, max_new_tokens=4).token_ids == longer.token_ids
    finally:
        engine.close()
