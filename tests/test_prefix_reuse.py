"""Prefix reuse: the next turn of a conversation prefills only its new tokens (counted at the
target's forward), with the same output as a fresh prefill, plain and speculative, resident and
streamed; a cancelled generation leaves the cache usable."""

import threading

import pytest
import torch

from offload_engine import Engine
from offload_engine.errors import GenerationCancelled
from offload_engine.speculation.decoder import common_prefix
from tiny_models import make_tiny_pair

TURNS = ["What is the capital of France?", "And of Italy?", "Say hello to the world."]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("prefix"))


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


class CancelAfterLayers:
    """The model's layers, setting `event` once `after` layers have run in all: a cancel that
    lands inside a given pass (a prefill chunk, a verification pass)."""

    def __init__(self, layers, event, after):
        self.layers, self.event, self.after, self.count = layers, event, after, 0

    def __iter__(self):
        for w in self.layers:
            self.count += 1
            if self.count == self.after:
                self.event.set()
            yield w

    def __getattr__(self, name):
        return getattr(self.layers, name)


@pytest.mark.parametrize("where", ["prefill", "verify"])
def test_a_cancel_inside_a_target_pass_leaves_both_caches_right(pair, tmp_path, monkeypatch, where):
    """Cancelled in the middle of a prefill chunk or of a verification pass (draft = target, so
    every draft token is accepted while the draft's cache is right): the next generation reuses
    what was kept and decodes exactly as from scratch, with the identical draft still always
    accepted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = pair[0]
    engine = _load(target, draft=target, tree="chain", tree_depth=4, max_batch_tokens=16)
    prompt = "Hello, world! How are you today?" + " The capital of France is Paris." * 6
    n_layers = engine.config.num_layers
    try:
        cancel = threading.Event()
        chunks = -(-len(engine.prompt_ids(prompt)) // 16)
        # the target's layers run: prefill chunks first, then one pass per step
        after = n_layers * (chunks // 2) + 2 if where == "prefill" else n_layers * (chunks + 3) + 2
        real_layers = engine.model.layers
        engine.model.layers = CancelAfterLayers(real_layers, cancel, after)
        with pytest.raises(GenerationCancelled):
            engine.generate(prompt, max_new_tokens=40, cancel=cancel)
        engine.model.layers = real_layers
        kept = engine.prefix_cache.tokens(engine.model)
        assert len(kept) <= engine.prefix_cache.sequence(engine.model, 1).cache.length
        if where == "prefill":
            assert len(kept) == 16 * (chunks // 2)  # the whole chunks before the cancelled one
        again = engine.generate(prompt, max_new_tokens=40)
        assert again.stats["cached_prompt_tokens"] == min(len(kept), len(engine.prompt_ids(prompt)) - 1)
        assert again.stats["tokens_per_step"] >= 3  # the draft's cache was kept right too
        engine.forget_prefix()
        assert engine.generate(prompt, max_new_tokens=40).token_ids == again.token_ids
    finally:
        engine.close()


def test_a_token_list_longer_than_its_cache_repairs_itself(pair):
    """If an interruption ever left the token list past the cache's length, the next prefill
    trusts only what the cache holds (no error, the same tokens as from scratch)."""
    engine = _load(pair[0])
    try:
        first = engine.generate("The capital of France is", max_new_tokens=8)
        seq = engine.prefix_cache.sequence(engine.model, 1)
        seq.cache.truncate(3)  # as if cut back with the token list not yet trimmed
        again = engine.generate("The capital of France is", max_new_tokens=8)
        assert again.stats["cached_prompt_tokens"] == 3 and again.token_ids == first.token_ids
    finally:
        engine.close()


@pytest.mark.parametrize("slots", [1, 2])
def test_a_side_request_keeps_the_conversation_cached_given_two_slots(pair, slots):
    engine = _load(pair[0], cache_slots=slots)
    try:
        history = [{"role": "user", "content": TURNS[0]}]
        first = engine.generate(messages=history, max_new_tokens=12)
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": TURNS[1]}]
        side = engine.generate("Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000", max_new_tokens=6)  # e.g. a title request
        assert side.stats["cached_prompt_tokens"] == 0
        second = engine.generate(messages=history, max_new_tokens=12)
        reused = second.stats["cached_prompt_tokens"]
        if slots == 2:
            assert reused >= first.stats["prompt_tokens"]  # the side request took the other slot
        else:
            assert reused < 4  # one slot: the side request replaced the conversation
        engine.forget_prefix()
        assert engine.generate(messages=history, max_new_tokens=12).token_ids == second.token_ids
    finally:
        engine.close()


def test_slot_choice_prefers_the_longest_shared_prefix_then_the_least_recently_used():
    from offload_engine.speculation.decoder import PrefixCache

    class Model:  # only its identity and new_cache matter here
        def new_cache(self, capacity):
            from offload_engine.runtime.kv_cache import KVCache
            return KVCache(1, 1, 2, capacity, torch.float32)

    m = Model()
    cache = PrefixCache(64, slots=3)
    for slot, toks in ((0, [1, 2, 3, 4]), (1, [1, 2, 9, 9, 9, 9]), (2, [7, 7])):
        cache.current = slot
        cache.sequence(m, 8).tokens.extend(toks)
        cache._used[slot] = slot + 1
    assert cache.select(m, [1, 2, 3, 4, 5]) == 0  # shares all of slot 0
    assert cache.select(m, [7, 7, 7]) == 2
    assert cache.select(m, [1, 2, 9, 5]) == 1  # keeps 3 of slot 1's 6 tokens: at least half
    assert cache.select(m, [5, 5]) == 0  # shares too little with any: the least recently used slot
