"""Speculative decoding through the engine: exactly plain greedy at T=0 for every tree kind and
draft (identical, partly agreeing, wrong), resident and streamed; the caches after every step
equal a fresh prefill of the committed tokens. The partly agreeing draft is the target with its
matrices perturbed (PARTIAL_NOISE): its steps accept some nodes and reject others, often below a
first child that is not the first-drawn one, which is what catches a cache that commits the wrong
path; the tests assert that this really happens."""

import pytest
import torch

import offload_engine.speculation.decoder as decoder
from offload_engine import Engine, UserError
from sequoia_trees.verify import VerifyResult, _children
from tiny_models import greedy_past_eos, make_tiny_pair, perturbed_copy

PROMPT = "The capital of France is"
KINDS = [("sequoia", 24, 5), ("specexec", 24, 5), ("specinfer", 0, 4), ("chain", 0, 5)]
PARTIAL_NOISE = 0.05
PARTIAL_FLOOR = 0.25  # at least this share of steps accepts 1 to depth-2 nodes (measured: 0.31-0.7)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def partial(pair, tmp_path_factory):
    return perturbed_copy(pair[0], tmp_path_factory.mktemp("partial") / "draft", PARTIAL_NOISE, seed=3)


def partly_accepted(lengths: list[int]) -> float:
    """The share of steps that accepted some tree nodes but not a whole path."""
    return sum(lengths[1:-1]) / max(1, sum(lengths))


@pytest.fixture(scope="module")
def plain(pair):
    return greedy_past_eos(pair[0], PROMPT, 40)[0].token_ids


@pytest.mark.parametrize("draft_kind", ["identical", "partial", "wrong"])
@pytest.mark.parametrize("kind,budget,depth", KINDS)
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_greedy_speculation_equals_plain_greedy(pair, partial, plain, tmp_path, monkeypatch, draft_kind, kind, budget,
                                                depth, offload):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target, wrong = pair
    draft = {"identical": target, "partial": partial, "wrong": wrong}[draft_kind]
    result, _ = greedy_past_eos(target, PROMPT, 40, draft=draft, tree=kind, tree_budget=budget or 1,
                                tree_depth=depth, specinfer_width=3, offload=offload)
    assert result.token_ids == plain
    s = result.stats
    assert s["tree"] == kind and s["target_steps"] >= 1
    assert s["target_passes"] == s["target_steps"] + 1  # the prefill pass, then one per step
    if draft_kind == "identical" and kind != "specexec":  # the draft always agrees: every level is accepted
        assert s["tokens_per_step"] >= depth - 1
    elif draft_kind == "identical":  # best-first may spend nodes on likely siblings before depth
        assert s["tokens_per_step"] > 2.0
    elif draft_kind == "partial":  # neither all nor nothing: a fixture that drifts fails here
        assert partly_accepted(s["accepted_lengths"]) >= PARTIAL_FLOOR, s["accepted_lengths"]
    else:
        assert s["tokens_per_step"] < 2.0


def _first_child_of_each_level(parents, tokens, best):
    """A greedy verifier broken on purpose: it accepts the first child at every level, whatever
    the target says."""
    kids, node, accepted = _children(parents), 0, []
    while kids.get(node):
        node = kids[node][0]
        accepted.append(node)
    return VerifyResult(tuple(accepted), int(best[node]), (0,) * len(accepted))


def test_a_broken_greedy_verifier_fails_the_equality_test(pair, partial, plain, monkeypatch):
    """Negative control for the test above: with the verifier broken, the tokens differ."""
    monkeypatch.setattr(decoder, "verify_greedy_argmax", _first_child_of_each_level)
    result, _ = greedy_past_eos(pair[0], PROMPT, 40, draft=partial, tree="sequoia", tree_budget=24, tree_depth=5)
    assert result.token_ids != plain


@pytest.mark.parametrize("modes", [("walk", "off"), ("table", "eager")], ids=["host", "device-path"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind,budget,depth", KINDS)
def test_kv_caches_after_every_step_equal_a_fresh_prefill(pair, partial, kind, budget, depth, temperature, modes):
    """After each speculative step, both caches hold exactly the K/V a fresh prefill of the
    committed sequence gives (the accepted path gathered into place, nothing else), with a draft
    whose steps accept part of the tree, below children that are not the first-drawn ones. Run
    as the CPU decodes (verification walked on the host, plain draft passes) and as a GPU does
    (the verification table, draft levels as padded static passes writing scratch slots)."""
    from offload_engine.speculation.decoder import SpeculativeDecoder
    from sequoia_trees.sampling import SamplingParams
    target_dir, _ = pair
    engine = Engine.load(target_dir, draft=partial, tree=kind, tree_budget=budget or 1, tree_depth=depth,
                         specinfer_width=3, progress=False)
    ids = engine.tokenizer.encode(PROMPT)
    dec = SpeculativeDecoder(engine.model, engine.draft, engine.tree, SamplingParams(temperature),
                             torch.Generator().manual_seed(0), 256, verify=modes[0], draft_graphs=modes[1])
    root = dec.first_token(dec.prefill(ids, 1024))
    seq, lengths, off_first = list(ids), [0] * depth, 0
    for _ in range(16):
        step = dec.step(root)
        seq.append(root)
        seq += step.tokens[:-1]
        root = step.tokens[-1]
        lengths[len(step.verify.accepted)] += 1
        off_first += any(rank > 0 for rank in step.verify.accepted_ranks)
        for model, cache in ((engine.model, dec.target_cache), (engine.draft, dec.draft_cache)):
            assert cache.length == len(seq)
            fresh = model.new_cache(len(seq))
            model.forward(torch.tensor(seq), torch.arange(len(seq)), fresh)
            # (float32 sums in another order: noise is ~1e-5; a wrong slot committed differs by O(0.1))
            torch.testing.assert_close(cache.k[:, :, :, : len(seq)], fresh.k[:, :, :, : len(seq)], atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(cache.v[:, :, :, : len(seq)], fresh.v[:, :, :, : len(seq)], atol=1e-4, rtol=1e-3)
    engine.close()
    assert partly_accepted(lengths) >= PARTIAL_FLOOR, lengths
    if kind != "chain":  # a chain has one child per node
        assert off_first >= 1, "no step accepted a child that was not drawn first"


def test_a_draft_with_another_vocabulary_is_refused(pair, tmp_path):
    import json
    import shutil
    other = shutil.copytree(pair[1], tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="vocabulary differs"):
        Engine.load(pair[0], tree="sequoia", draft=other, progress=False)


def test_bad_tree_arguments(pair):
    with pytest.raises(UserError, match="--tree"):
        Engine.load(pair[0], draft=pair[1], tree="beam", progress=False)
    with pytest.raises(UserError, match="no tree of 100 nodes"):
        Engine.load(pair[0], draft=pair[1], tree="sequoia", tree_budget=100, tree_depth=2, progress=False)


@pytest.mark.parametrize("mode", ["on-policy", "teacher-forced"])
def test_acceptance_command_with_an_identical_draft(pair, tmp_path, capsys, mode):
    """A draft identical to the target is accepted at rank 1 every time at temperature 0."""
    import json

    from offload_engine.apps.cli import main
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Hello there"}]}\nThe capital of France is\n')
    out = tmp_path / "acc.json"
    assert main(["acceptance", "--target", str(pair[0]), "--draft", str(pair[0]), "--prompts", str(prompts),
                 "--out", str(out), "--width", "4", "--mode", mode, "--max-new-tokens", "12"]) == 0
    data = json.loads(out.read_text())
    assert data["acceptance"][0] == pytest.approx(1.0) and sum(data["acceptance"][1:]) == 0.0
    assert data["mode"] == mode
    if mode == "on-policy":  # the measuring tree's 8 levels: each step accepts its 7 first children
        assert data["depth"] == 8 and data["samples"] >= 4  # (two prompts, 12 tokens, 8 a step)
        assert data["rank_evidence"]["accepted"][0] == data["rank_evidence"]["at_risk"][0] == 7 * data["samples"]
    else:
        assert data["samples"] > 5
    from sequoia_trees.acceptance import AcceptanceVector
    assert AcceptanceVector.from_json(out.read_text()).width == 4  # loadable as --acceptance


def test_acceptance_command_with_a_wrong_draft_sampled(pair, tmp_path):
    from offload_engine.apps.cli import main
    out = tmp_path / "acc.json"
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\nNumbers: 1 2 3\n")
    assert main(["acceptance", "--target", str(pair[0]), "--draft", str(pair[1]), "--prompts", str(prompts),
                 "--out", str(out), "--width", "4", "--temperature", "0.8", "--max-new-tokens", "16"]) == 0
    import json
    p = json.loads(out.read_text())["acceptance"]
    assert len(p) == 4 and 0 <= sum(p) < 0.9


def test_eos_inside_an_accepted_path_and_stop_strings_end_generation_as_in_plain(pair, plain):
    target, _ = pair
    eos = plain[12]
    cut = plain.index(eos) + 1  # the first occurrence ends plain decoding
    base = Engine.load(target, progress=False)
    spec = Engine.load(target, draft=target, tree="chain", tree_depth=6, progress=False)  # accepts whole chains
    for engine in (base, spec):
        engine.eos_token_ids = frozenset({eos})
    a = base.generate(PROMPT, max_new_tokens=40)
    b = spec.generate(PROMPT, max_new_tokens=40)
    assert a.token_ids == plain[:cut] == b.token_ids and b.finish_reason == "stop"
    assert b.stats["tokens_per_step"] > 1.0  # the EOS really arrived inside a multi-token step
    for engine in (base, spec):
        engine.eos_token_ids = frozenset()
    text = base.generate(PROMPT, max_new_tokens=40).text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    pieces = []
    c = base.generate(PROMPT, max_new_tokens=40, stop=[stop])
    d = spec.generate(PROMPT, max_new_tokens=40, stop=[stop], on_token=lambda t, s: pieces.append(s))
    assert c.text == d.text == text[: text.find(stop)] == "".join(pieces)


@pytest.mark.parametrize("draft", ["partial", "self-q8"])
def test_plain_generation_on_an_engine_with_a_draft(pair, partial, plain, tmp_path, monkeypatch, draft):
    """generate(plain=True), the demo's yardstick: the draft sits out (one token a step, every
    step timed), the tokens are plain greedy's, and a speculative generation after it (the draft's
    cache, or the shared one, not fed by the plain one) is still plain greedy too."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = Engine.load(pair[0], draft=partial if draft == "partial" else draft, draft_group_size=32,
                         tree="sequoia", tree_budget=16, tree_depth=5, offload="disk", progress=False)
    engine.eos_token_ids = frozenset()
    try:
        first = engine.generate(PROMPT, max_new_tokens=40)
        again = engine.generate(PROMPT, max_new_tokens=40, plain=True)
        assert again.token_ids == first.token_ids == plain
        s = again.stats
        assert s["tree"] == "none" and s["target_steps"] == 39 and s["tokens_per_step"] == 1.0
        assert s["cached_prompt_tokens"] > 0  # the conversation's K/V reused from the first
        assert len(s["step_seconds"]) == 39 and all(t > 0 for t in s["step_seconds"])
        assert s["overlap"] is None and s["auto"] is None
        longer = engine.generate(PROMPT + " Paris", max_new_tokens=30)
        want = greedy_past_eos(pair[0], PROMPT + " Paris", 30)[0].token_ids
        assert longer.token_ids == want and longer.stats["tokens_per_step"] > 1.5
        assert len(first.stats["step_seconds"]) == first.stats["target_steps"]
    finally:
        engine.close()
