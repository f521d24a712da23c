"""Suffix drafts (`offload_engine.speculation.suffix`): the match against a brute-force search,
the proposal's tree against counts done by hand, the store's cap and keys, the graft onto a model
draft's tree; then through the engine: greedy output equal to plain decoding for suffix-only and
hybrid trees (static and best-first), with the store of an earlier request making most tokens
free, the caches equal to a fresh prefill after every step, and a request under one store key
never drafting from another key's text."""

import numpy as np
import pytest
import torch

from offload_engine import Engine, UserError
from offload_engine.speculation import suffix
from offload_engine.speculation.suffix import (SuffixDrafter, SuffixStore, graft, longest_match, propose,
                                               split_draft)
from tiny_models import greedy_past_eos, make_tiny_pair, perturbed_copy


def brute_longest(text, pattern, max_len):
    best, ends = 0, []
    for e in range(len(text) - 1):
        if text[e + 1] < 0:
            continue
        m = 0
        while m < min(max_len, len(pattern)) and e - m >= 0 and text[e - m] == pattern[-1 - m]:
            m += 1
        if m > best:
            best, ends = m, [e]
        elif m == best and m > 0:
            ends.append(e)
    return best, ends


def test_longest_match_equals_a_brute_force_search():
    """2,000 random texts over 3 to 6 tokens with separators, patterns from the text and not."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        vocab = int(rng.integers(3, 7))
        text = rng.integers(-1, vocab, int(rng.integers(1, 40))).astype(np.int32)
        if rng.random() < 0.5 and len(text) > 3:
            i = int(rng.integers(1, len(text)))
            pattern = np.abs(text[max(0, i - 6):i])
        else:
            pattern = rng.integers(0, vocab, int(rng.integers(1, 8))).astype(np.int32)
        max_len = int(rng.integers(1, 9))
        m, ends = longest_match(text, pattern, max_len)
        bm, bends = brute_longest(text.tolist(), pattern.tolist(), max_len)
        assert m == bm and ends.tolist() == (bends if bm else []), (text, pattern, max_len)


def test_a_proposal_counts_continuations_as_done_by_hand(monkeypatch):
    """After "7 8", the text continues 1 2 (three times), 1 3 (once) and 4 (twice, the last time
    at a separator): P(1) = 4/6, P(4) = 2/6, P(1 2) = 4/6 * 3/4 = 1/2, P(1 3) = 1/6 (with a
    separator after "7 8 4" the 4 ends its row). The match is "9 7 8" in one place only, so the
    longest match is m = 2 ("7 8"), and with SPEC_FACTOR 2 the tree holds 4 nodes below the
    root, most probable first: 1, 1-2, 4, 1-3."""
    monkeypatch.setattr(suffix, "SPEC_FACTOR", 2.0)
    seqs = [[7, 8, 1, 2], [7, 8, 1, 2], [5, 7, 8, 1, 2], [7, 8, 1, 3], [7, 8, 4], [6, 7, 8, 4, 0]]
    text = np.array(sum(([*s, -1] for s in seqs), []), dtype=np.int32)
    p = propose(text, np.array([9, 7, 8]), 8, max_nodes=10, source="store")
    assert p.match_length == 2
    assert p.parents == (-1, 0, 1, 0, 1) and p.tokens == (8, 1, 2, 4, 3)
    np.testing.assert_allclose(p.probs, [1, 4 / 6, 1 / 2, 2 / 6, 1 / 6])
    # the budget follows the match length (factor 1: two nodes), and max_nodes caps it
    monkeypatch.setattr(suffix, "SPEC_FACTOR", 1.0)
    assert propose(text, np.array([9, 7, 8]), 8, 10, "store").tokens == (8, 1, 2)
    assert propose(text, np.array([9, 7, 8]), 8, 2, "store").tokens == (8, 1)
    # below MIN_TOKEN_PROB nothing is proposed; no match: the one-node tree
    monkeypatch.setattr(suffix, "MIN_TOKEN_PROB", 0.5)
    monkeypatch.setattr(suffix, "SPEC_FACTOR", 2.0)
    assert propose(text, np.array([9, 7, 8]), 8, 10, "store").tokens == (8, 1, 2)
    assert propose(text, np.array([9, 9]), 9, 10, "store").size == 1


def test_the_drafter_prefers_the_source_with_the_larger_score():
    """Text so far "3 4 5 0 1 3", root 4: in the request's own text "3 4" matched (m = 2) and
    continues 5 0 (score 2); the store holds "0 1 3 4 6 7 8 9" (m = 4, continuing 6 7 8 9, score
    4): the store's proposal wins. With the store empty, the text's own is used."""
    store = np.array([0, 1, 3, 4, 6, 7, 8, 9, -1] * 2, dtype=np.int32)
    d = SuffixDrafter([3, 4, 5, 0, 1, 3], store, 8)
    p = d.propose(4)
    assert p.source == "store" and p.tokens == (4, 6, 7, 8, 9) and p.match_length == 4
    d2 = SuffixDrafter([3, 4, 5, 0, 1, 3], np.empty(0, np.int32), 8)
    p2 = d2.propose(4)
    assert p2.source == "context" and p2.tokens == (4, 5, 0)
    assert d.stats()["store_matched_steps"] == 1 and d2.stats()["matched_steps"] == 1


def test_the_store_keeps_under_its_cap_forgets_the_oldest_and_keeps_keys_apart():
    store = SuffixStore(capacity=100)
    rng = np.random.default_rng(1)
    added = []
    for i in range(300):
        ids = rng.integers(0, 50, int(rng.integers(1, 40))).tolist()
        key = ("a", "b", None)[i % 3]
        store.add(key, [], ids)
        added.append((key, ids))
        assert store.tokens <= 100
    # what is left: the newest sequences, whole, in order, per key
    kept, total = [], 0
    for key, ids in reversed(added):
        if total + len(ids) > 100:
            break
        kept.append((key, ids))
        total += len(ids)
    assert store.tokens == total
    for key in ("a", "b", None):
        want = sum(([*ids, -1] for k, ids in reversed(kept) if k == key), [])
        assert store.snapshot(key).tolist() == want
    assert store.snapshot("never").size == 0
    big = SuffixStore(capacity=10)
    big.add("k", [], list(range(25)))  # one sequence over the cap keeps its last tokens
    assert big.snapshot("k").tolist() == list(range(15, 25)) + [-1]
    with pytest.raises(ValueError):
        SuffixStore(-1)


def test_the_store_adds_only_what_a_conversation_has_not_stored_yet():
    """Turn 2's prompt repeats turn 1's prompt and answer: only its new tokens are stored, and they
    continue the stored text (no separator), so a match can run across the turns; another
    conversation under the same key is stored whole, after a separator."""
    store = SuffixStore(100)
    store.add("k", [1, 2, 3], [4, 5])
    store.add("k", [1, 2, 3, 4, 5, 6, 7], [8, 9])
    assert store.tokens == 9 and store.snapshot("k").tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, -1]
    store.add("k", [1, 2, 30], [31])  # shares [1, 2] only: the rest is new, not a continuation
    assert store.snapshot("k").tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, -1, 30, 31, -1]
    assert store.tokens == 11
    store.add("other", [1, 2, 3], [])  # keys never share
    assert store.snapshot("other").tolist() == [1, 2, 3, -1]


def test_graft_adds_only_paths_the_model_did_not_propose():
    # model tree: root 0 -> a(10), b(11); a -> c(12)
    parents, tokens = [-1, 0, 0, 1], [99, 10, 11, 12]
    # proposal: root -> 10 -> 12 -> 13, and root -> 14
    prop = suffix.SuffixProposal((-1, 0, 1, 2, 0), (99, 10, 12, 13, 14), (1, .9, .8, .7, .2), 4, "store")
    p, t, added = graft(parents, tokens, prop, room=8)
    assert p == [-1, 0, 0, 1, 3, 0] and t == [99, 10, 11, 12, 13, 14] and added == [4, 5]
    p, t, added = graft(parents, tokens, prop, room=1)  # room for one new node: the first
    assert added == [4] and t == [99, 10, 11, 12, 13]


def test_split_draft_names():
    assert split_draft("suffix") == (None, True)
    assert split_draft("default+suffix") == ("default", True)
    assert split_draft("/a/b+suffix") == ("/a/b", True)
    assert split_draft("default") == ("default", False)
    assert split_draft(None) == (None, False)


# ---- through the engine ------------------------------------------------------------------------

PROMPT = "one two three four five six seven. one two three four five six seven. one two"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("suffix"))


@pytest.fixture(scope="module")
def partial(pair, tmp_path_factory):
    return perturbed_copy(pair[0], tmp_path_factory.mktemp("partial") / "draft", 0.05, seed=3)


@pytest.fixture(scope="module")
def plain(pair):
    return greedy_past_eos(pair[0], PROMPT, 40)[0].token_ids


def twice(folder, **load_kw):
    """Two greedy generations of the same prompt on one engine (the second drafts from the store
    the first filled), end-of-sequence ignored."""
    engine = Engine.load(folder, progress=False, **load_kw)
    engine.eos_token_ids = frozenset()
    try:
        first = engine.generate(PROMPT, max_new_tokens=40)
        engine.forget_prefix()  # the second prefills afresh: its speed comes from the store
        second = engine.generate(PROMPT, max_new_tokens=40)
        return first, second
    finally:
        engine.close()


@pytest.mark.parametrize("draft,kind,offload", [("suffix", "sequoia", "none"), ("suffix", "sequoia", "disk"),
                                                ("partial+suffix", "sequoia", "none"),
                                                ("partial+suffix", "specexec", "disk"),
                                                ("wrong+suffix", "sequoia", "none")])
def test_greedy_suffix_and_hybrid_decoding_equal_plain_greedy(pair, partial, plain, tmp_path, monkeypatch, draft,
                                                              kind, offload):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target, wrong = pair
    name = draft.replace("partial", str(partial)).replace("wrong", str(wrong))
    first, second = twice(target, draft=name, tree=kind, tree_budget=12, tree_depth=4, offload=offload)
    assert first.token_ids == plain and second.token_ids == plain
    s = second.stats
    assert s["tree"] == ("suffix" if draft == "suffix" else f"{kind}+suffix")
    assert s["suffix"]["store_matched_steps"] >= 1
    # the second request's text is all in the store: most of its tokens come free
    assert s["suffix"]["accepted_tokens"] >= 20 and s["tokens_per_step"] >= 2.0, s
    assert s["target_passes"] == s["target_steps"] + 1


def test_a_broken_fixed_candidate_rule_fails_the_equality_test(pair, plain, monkeypatch):
    """Negative control: a verifier that accepts every suffix node (as if the target agreed) makes
    other tokens."""
    import offload_engine.speculation.decoder as decoder
    from sequoia_trees.verify import VerifyResult, _children

    def accept_fixed(parents, tokens, best):
        kids, node, acc = _children(parents), 0, []
        while kids.get(node):
            node = kids[node][0]
            acc.append(node)
        return VerifyResult(tuple(acc), int(best[node]), (0,) * len(acc))

    monkeypatch.setattr(decoder, "verify_greedy_argmax", accept_fixed)
    _, second = twice(pair[0], draft="suffix", adapt=False)  # every proposal runs (no gate weighing timings)
    assert second.token_ids != plain


def cycling(arms=("hybrid", "suffix", "model", "hybrid", "hybrid", "suffix")):
    """A step chooser that runs each arm in turn, whatever it predicts."""
    state = {"k": 0, "used": []}

    def choose(proposal):
        arm = arms[state["k"] % len(arms)]
        state["k"] += 1
        state["used"].append(arm)
        return arm
    choose.used = state["used"]
    return choose


@pytest.fixture(scope="module")
def stores():
    """The hybrid tests' stores of earlier text, by (tree kind, temperature): the same engine's same
    seeded answers whether the arms switch or not, generated by the first test that needs them."""
    return {}


@pytest.mark.parametrize("switching", [False, True], ids=["hybrid", "arms-switching"])
@pytest.mark.parametrize("temperature", [0.0, 0.3])
@pytest.mark.parametrize("kind", ["sequoia", "specexec"])
def test_caches_after_every_hybrid_step_equal_a_fresh_prefill(pair, partial, stores, kind, temperature, switching):
    """The target's cache holds every committed token; the draft's a prefix of them (a grafted
    node it never ran on, or a suffix-only step it sat out, is caught up at its next step), each
    exactly a fresh prefill's K/V. With `switching`, the steps cycle through the three arms."""
    from offload_engine.speculation.decoder import SpeculativeDecoder
    from sequoia_trees.sampling import SamplingParams
    engine = Engine.load(pair[0], draft=partial, tree=kind, tree_budget=12, tree_depth=4, progress=False)
    ids = engine.tokenizer.encode(PROMPT)
    # a store holding a continuation the draft cannot know: grafted nodes get accepted
    engine.eos_token_ids = frozenset()
    if (kind, temperature) not in stores:  # continuations at this temperature
        stores[kind, temperature] = [t for seed in range(6) for t in ids + engine.generate(
            PROMPT, max_new_tokens=40, temperature=temperature, seed=seed).token_ids + [-1]]
    seen = stores[kind, temperature]
    drafter = SuffixDrafter(ids, np.array(seen, dtype=np.int32), 65)
    choose = cycling() if switching else None
    dec = SpeculativeDecoder(engine.model, engine.draft, engine.tree, SamplingParams(temperature),
                             torch.Generator().manual_seed(0), 256, suffix=drafter, choose=choose)
    root = dec.first_token(dec.prefill(ids, 1024))
    seq, lagged = list(ids), 0
    for _ in range(12):
        step = dec.step(root)
        seq.append(root)
        seq += step.tokens[:-1]
        root = step.tokens[-1]
        assert dec.target_cache.length == len(seq)
        lagged += dec.draft_cache.length < len(seq)
        for model, cache in ((engine.model, dec.target_cache), (engine.draft, dec.draft_cache)):
            n = cache.length
            assert dec.seqs[0 if model is engine.model else 1].tokens == seq[:n]
            fresh = model.new_cache(n)
            model.forward(torch.tensor(seq[:n]), torch.arange(n), fresh)
            torch.testing.assert_close(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-4, rtol=1e-3)
    engine.close()
    assert dec.suffix_accepted >= 1
    if temperature == 0:  # greedy follows the stored continuation: grafted nodes were accepted
        assert lagged >= 1
    if switching:
        assert {"hybrid", "suffix", "model"} <= set(choose.used)


def test_one_store_key_never_drafts_from_another(pair):
    """The same prompt under key A twice, then under key B: B's request finds nothing in the
    store (its key's is empty) and A's second does."""
    engine = Engine.load(pair[0], draft="suffix", adapt=False, progress=False)  # every proposal runs
    engine.eos_token_ids = frozenset()
    try:
        a1 = engine.generate(PROMPT, max_new_tokens=30, suffix_key="A")
        engine.forget_prefix()
        b = engine.generate(PROMPT, max_new_tokens=30, suffix_key="B")
        engine.forget_prefix()
        a2 = engine.generate(PROMPT, max_new_tokens=30, suffix_key="A")
    finally:
        engine.close()
    assert a1.token_ids == b.token_ids == a2.token_ids
    assert b.stats["suffix"]["store_tokens"] == 0 and b.stats["suffix"]["store_matched_steps"] == 0
    assert a2.stats["suffix"]["store_matched_steps"] >= 1
    assert a2.stats["target_steps"] < b.stats["target_steps"]


def test_bad_suffix_arguments(pair, capsys):
    from offload_engine.apps.cli import main
    with pytest.raises(UserError, match="suffix-memory"):
        Engine.load(pair[0], draft="suffix", suffix_memory=-5, progress=False)
    for bad in ("+suffix", " +suffix", "suffix+suffix", "default+suffix+suffix"):
        with pytest.raises(UserError, match="before '\\+suffix'"):
            Engine.load(pair[0], draft=bad, progress=False)
    assert main(["plan", "--target", str(pair[0]), "--draft", "+suffix"]) == 2
    assert main(["profile", "--target", str(pair[0]), "--draft", "suffix"]) == 2
    err = capsys.readouterr().err
    assert "name a draft model before '+suffix'" in err and "profile needs a draft model" in err
    assert "Traceback" not in err


# ---- choosing per step: suffix, model, or both (--tree auto) -------------------------------------

def chain(tokens, match_length):
    n = len(tokens)
    return suffix.SuffixProposal(tuple(range(-1, n)), (0, *tokens), (1.0,) * (n + 1), match_length, "store")


def test_the_suffix_estimate_learns_how_far_the_target_follows_by_match_length():
    """A simulated target follows a 4-token proposal with hazard 0.9 per level after long matches
    (8 tokens) and 0.2 after one-token matches; each step's output is cut at a random length (a
    step shows what it emitted, no more). Before any evidence it expects what the proposal's own
    frequencies say (its score). After 400 steps of each, the expected accepted tokens
    are within 0.25 of the truth (0.9 + 0.81 + 0.73 + 0.66 = 3.10; 0.2 + 0.04 + ... = 0.25); the
    evidence (weights fading by 0.98 per observation: about 50 effective) gives a standard error
    near 0.1 on the first."""
    from offload_engine.planning.adaptive import SuffixEstimate
    rng = np.random.default_rng(5)
    est = SuffixEstimate()
    # before any evidence, the proposal's own frequency estimate: its score
    branching = suffix.SuffixProposal((-1, 0, 0, 1, 3), (0, 5, 6, 7, 8), (1.0, 0.6, 0.3, 0.5, 0.2), 4, "store")
    assert est.expected(branching) == pytest.approx(branching.score)
    truth = {8: 0.9, 1: 0.2}
    for _ in range(400):
        for m, h in truth.items():
            prop = chain([11, 12, 13, 14], m)
            out = []
            for tok in (11, 12, 13, 14):
                out.append(tok if rng.random() < h else 99)
                if out[-1] == 99:
                    break
            if len(out) == 4:
                out.append(7)  # the bonus after a fully accepted path
            est.observe(prop, out[: int(rng.integers(1, 6))])  # censored at a random length
    for m, h in truth.items():
        want = sum(h ** j for j in range(1, 5))
        assert abs(est.expected(chain([11, 12, 13, 14], m)) - want) < 0.25, (m, est.expected(chain([1] * 4, m)))


def test_the_arm_chosen_is_the_one_predicted_fastest():
    """Plain decoding chosen (a draft level costs most of a pass), a pass that costs more the wider
    it is: a proposal the target follows far runs alone ("suffix"); one it rarely follows does not
    ("model", here plain decoding). With a tree that pays and a cheap draft, a proposal the target
    follows half the time is grafted on ("hybrid"); one it always follows runs alone."""
    from offload_engine.planning.adaptive import OnlinePlanner
    from sequoia_trees.acceptance import AcceptanceVector
    from sequoia_trees.dp import TreeTable
    from sequoia_trees.optimizer import Candidates, Timings
    ns = (1, 2, 4, 8, 16, 32)
    weak = AcceptanceVector((0.2, 0.05))
    slow_draft = Timings(ns, tuple(1.0 + 0.1 * n for n in ns), (1, 16), (0.9, 0.9))
    planner = OnlinePlanner(weak, slow_draft, Candidates(weak, [2, 4, 8], 4, TreeTable(weak, 8, 4)))
    assert planner.begin().kind == "none"
    for _ in range(200):
        planner.observe_suffix(chain([1, 2, 3, 4], 8), [1, 2, 3, 4, 5])
        planner.observe_suffix(chain([1, 2, 3, 4], 1), [9])
    assert planner.choose_arm(chain([1, 2, 3, 4], 8)) == "suffix"
    assert planner.choose_arm(chain([1, 2, 3, 4], 1)) == "model"
    # with one token left to make, the proposal's tokens past it are worth nothing: a plain step
    # hands out the same token for a narrower pass
    planner.begin(1)
    assert planner.choose_arm(chain([1, 2, 3, 4], 8)) == "model"
    strong = AcceptanceVector((0.8, 0.1))
    cheap_draft = Timings(ns, tuple(1.0 + 0.001 * n for n in ns), (1, 16), (0.01, 0.01))
    planner = OnlinePlanner(strong, cheap_draft, Candidates(strong, [2, 4, 8], 4, TreeTable(strong, 8, 4)))
    assert planner.begin().kind == "sequoia"
    rng = np.random.default_rng(2)
    for _ in range(300):  # the target follows the proposal half the time at each level
        follows = rng.random(4) < 0.5
        cut = int(np.argmin(follows)) if not follows.all() else 4
        planner.observe_suffix(chain([1, 2, 3, 4], 12), [1, 2, 3, 4][:cut] + [9])
    # the model's tree alone and the proposal alone each stop short where the other may go on
    assert planner.choose_arm(chain([1, 2, 3, 4], 12)) == "hybrid"
    for _ in range(300):  # the target always follows it: the proposal alone is as good, and cheaper
        planner.observe_suffix(chain([1, 2, 3, 4], 12), [1, 2, 3, 4, 5])
    assert planner.choose_arm(chain([1, 2, 3, 4], 12)) == "suffix"


def test_greedy_hybrid_auto_with_every_arm_equals_plain_greedy(pair, partial, plain, tmp_path, monkeypatch):
    """The engine's loop with `--tree auto` and `+suffix`, the planner's choice of arm replaced by
    one that cycles through all three: the tokens are plain greedy's, in a first request and in a
    second that drafts from the first's text, and the stats name the arms the steps ran."""
    import offload_engine.planning.profiler as profiler
    from offload_engine.planning.adaptive import OnlinePlanner
    from test_auto_tree import _fake_profile
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(profiler, "measure", lambda engine, *a, **k: _fake_profile(engine, pass_s=0.05, draft_s=0.01))
    choose = cycling()
    monkeypatch.setattr(OnlinePlanner, "choose_arm", lambda self, proposal: choose(proposal))
    first, second = twice(pair[0], draft=f"{partial}+suffix", tree="auto")
    assert first.token_ids == plain and second.token_ids == plain
    labels = set()
    for r in (first, second):
        trees = r.stats["auto"]["tree_steps"]
        assert sum(trees.values()) == r.stats["target_steps"]
        labels |= set(trees)
    assert {"hybrid", "suffix", "model"} <= set(choose.used)
    assert "suffix" in labels and any(label.endswith("+suffix") for label in labels), labels
    assert second.stats["suffix"]["accepted_tokens"] >= 10


def _gate(plain_s: float, per_node_s: float | None, follows: dict[int, float] | None = None):
    """A SuffixGate that has measured plain steps of plain_s and (unless None) wider passes costing
    per_node_s a node more, and has seen the target follow 4-token chains after m-token matches
    with the hazard follows[m] at every level."""
    from offload_engine.planning.adaptive import SuffixGate
    gate = SuffixGate()
    for _ in range(10):
        gate.observe(None, 1, plain_s, [9])
        if per_node_s is not None:
            gate.observe(None, 9, plain_s + 8 * per_node_s, [9])
    rng = np.random.default_rng(4)
    for m, h in (follows or {}).items():
        for _ in range(300):
            out = []
            for tok in (1, 2, 3, 4):
                out.append(tok if rng.random() < h else 99)
                if out[-1] == 99:
                    break
            gate.suffix.observe(chain([1, 2, 3, 4], m), out)
    return gate


def test_the_suffix_gate_runs_skips_or_trims_by_measured_cost():
    """`--draft suffix` alone, `--tree auto`: with nothing measured the proposal runs (SuffixDecoding's
    rule, and the measurement); with free width any proposal runs whole; with a pass that costs 10%
    more per node, a proposal the target follows 95% of the time per level runs whole, one it
    follows 2% of the time does not run (plain decoding: 1 / 0.10 tokens/s beats about 1.06 / 0.11
    at one node, the estimate's prior counted in), and a chain whose first node is likely and the
    rest are not is cut to its first node (1.9 / 0.12 against 2.04 / 0.14 for two nodes)."""
    from offload_engine.planning.adaptive import SuffixGate
    four = chain([1, 2, 3, 4], 8)
    assert SuffixGate().choose(four) == ("suffix", four)
    assert _gate(0.1, 0.0, {8: 0.1}).choose(four) == ("suffix", four)
    gate = _gate(0.1, 0.01, {8: 0.95, 1: 0.02})
    assert gate.choose(four) == ("suffix", four)
    assert gate.choose(chain([1, 2, 3, 4], 1))[0] == "model"
    assert gate.pass_seconds(5) == pytest.approx(0.14)
    # the proposal's own estimate (no evidence for 3-5-token matches): its first node at 0.9, then 0.15 each
    steep = suffix.SuffixProposal((-1, 0, 1, 2, 3), (0, 1, 2, 3, 4), (1.0, 0.9, 0.135, 0.02, 0.003), 4, "store")
    arm, part = _gate(0.1, 0.02).choose(steep)
    assert arm == "suffix" and part.tokens == (0, 1) and part.parents == (-1, 0)
    assert gate.stats()["gate_skips"] == 1 and gate.stats()["gate_ms_per_node"] == pytest.approx(10.0)


def test_greedy_suffix_with_the_gate_equals_plain_greedy(pair, plain, monkeypatch):
    """The engine's loop with `--draft suffix --tree auto`: the real gate, then a gate whose choice
    cycles through running the whole proposal, its first node and none of it. The tokens are plain
    greedy's each time, in a first request and in a second that drafts from the first's text; the
    cycled run trims and skips."""
    from offload_engine.planning.adaptive import SuffixGate, _trimmed
    first, second = twice(pair[0], draft="suffix", tree="auto")
    assert first.token_ids == plain and second.token_ids == plain
    # the gate decided every matched step (whether it ran a proposal depends on this machine's timings)
    sfx = second.stats["suffix"]
    assert sfx["matched_steps"] >= 1 and sfx["gate_runs"] + sfx["gate_skips"] == sfx["matched_steps"], sfx
    used = []

    def cycle(self, proposal):
        k = len(used) % 3
        used.append(k)
        return ("suffix", proposal) if k == 0 else ("suffix", _trimmed(proposal, 1)) if k == 1 else ("model", proposal)
    monkeypatch.setattr(SuffixGate, "choose", cycle)
    first, second = twice(pair[0], draft="suffix", tree="auto")
    assert first.token_ids == plain and second.token_ids == plain
    assert set(used) == {0, 1, 2} and second.stats["suffix"]["accepted_tokens"] >= 5
