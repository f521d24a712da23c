"""Distribution exactness of the real speculative loop, for every stochastic tree kind: the draft
model grows the tree with its KV cache and masks, the target verifies it in one pass, the caches
commit, exactly as `Engine.generate` runs a step (`SpeculativeDecoder`, with the verifier flags the
decoder itself chooses per kind). The first two tokens emitted after a fixed state are compared
with the target's exact joint distribution, computed from its own probabilities.

The fixture is not degenerate: tiny random Llama models over an 8-token vocabulary whose
next-token distributions spread over every token (the largest probability at the test state is
0.23), and a draft that is the target with its matrices perturbed, so that it partly agrees (the
overlap sum(min(p, q)) at the root is 0.75): most steps accept some nodes of the tree and reject
others (the test asserts it, so that a fixture drifting into all-or-nothing fails loudly).

Two chi-square tests run on each sample (cells with expected count under 5 pooled): the first
token's marginal (7 degrees of freedom: a bias at the root shows there with most power) and the
2-token joint (about 60: a bias at an inner node shows only there). Each must give p > ALPHA / 2 =
5e-5, so a correct sampler fails about one run in 10,000.

Negative controls: each kind is also run with a verifier broken the way real bugs break it, and
the same test must reject it, or the suite fails:
  * specinfer: its with-replacement draws verified as if drawn without replacement;
  * specexec: the draws left out of the best-first tree dropped from verification;
  * sequoia and chain: every node verified against the root's draft distribution.
With adaptation on (`--tree auto`'s online re-planning), the same test runs with every step's
tree chosen by a real `OnlinePlanner` from the steps before it, set to switch as often as it can
(`test_first_two_tokens_with_the_tree_re_chosen_every_step_have_the_target_distribution`): plain
steps, trees of three sizes, and switches between a sample's two steps all happen (asserted);
its negative control breaks the verifier as for sequoia, with sequoia's sample size.
Suffix drafts (`test_first_two_tokens_with_suffix_drafts_have_the_target_distribution`): trees
read off a fixed store of earlier text, alone (every node a fixed proposal) and grafted onto the
draft's Sequoia tree; their control verifies the suffix nodes as if the draft had drawn them.
A draft sharing the target's KV cache whose next trees are grown ahead (a substitute
self-draft with overlap, `test_four_tokens_with_a_shared_cache_and_trees_grown_ahead_...`): four
tokens, the first two's joint and the later two's, whose steps start from trees grown ahead; its
control breaks the verifier as for sequoia.
Power, written down: a bias of Cohen's effect size w = sqrt(sum (p_bad - p)^2 / p) gives the
chi-square statistic a noncentrality lambda = N w^2. Each control's w was measured on this fixture
with 4,000 samples (CONTROL_BIAS), and each kind's sample size N (SAMPLES) is chosen so that the
test rejects its control with probability at least 0.99; `test_sample_sizes_give_the_power_written_down`
recomputes that from the noncentral chi-square, and the controls themselves must be rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

import offload_engine.speculation.decoder as decoder
from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.model import Transformer
from offload_engine.speculation.decoder import TREE_KINDS, SpeculativeDecoder, TreeSpec
from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.sampling import SamplingParams, logits_to_probs
from sequoia_trees.verify import verify_stochastic
from streams import shares
from tiny_models import perturbed_copy

V = 8
ALPHA = 1e-4  # the two tests share it: each must give p > ALPHA / 2
PARAMS = SamplingParams(1.0, 1.0)
PROMPT, ROOT = [1, 5, 2], 3
SHAPE = AcceptanceVector((0.5, 0.2, 0.1))
SPECS = {
    "sequoia": TreeSpec("sequoia", 8, 4, acceptance=SHAPE),
    "specexec": TreeSpec("specexec", 8, 4, acceptance=AcceptanceVector((0.4, 0.2, 0.1, 0.05, 0.03, 0.02))),
    "specinfer": TreeSpec("specinfer", 0, 4, specinfer_width=3),
    "chain": TreeSpec("chain", 0, 4),
}


def _specinfer_as_without_replacement(*args, **kw):
    return verify_stochastic(*args, **{**kw, "without_replacement": True})


def _extra_draws_dropped(*args, **kw):
    return verify_stochastic(*args, **{**kw, "extra_draws": None})


def _root_draft_distribution_everywhere(parents, tokens, target_probs, draft_probs, *args, **kw):
    return verify_stochastic(parents, tokens, target_probs, draft_probs[:1].expand_as(draft_probs), *args, **kw)


CONTROLS = {
    "specinfer": _specinfer_as_without_replacement,
    "specexec": _extra_draws_dropped,
    "sequoia": _root_draft_distribution_everywhere,
    "chain": _root_draft_distribution_everywhere,
}
# kind: (the statistic the control's bias shows in, its effect size w measured with 4,000 samples)
CONTROL_BIAS = {"specinfer": ("first", 0.16), "specexec": ("joint", 0.21), "sequoia": ("joint", 0.277),
                "chain": ("joint", 0.19)}
SAMPLES = {"specinfer": 2500, "specexec": 2500, "sequoia": 1500, "chain": 3000}
MIN_POWER = 0.99


def tiny(path, seed):
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      initializer_range=0.12)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def load(path):
    return Transformer.from_checkpoint(Checkpoint(path, load_config(path)), torch.float32)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    target = tiny(root / "target", 1)
    return target, perturbed_copy(target, root / "draft", 0.6, 5, sharpen=2.0)


@pytest.fixture(scope="module")
def models(paths):
    return load(paths[0]), load(paths[1])


def _worker(paths, kind: str, n: int, seed: int, broken: bool):
    """One process's share of the samples (the decoder's verifier broken as CONTROLS says when asked;
    set either way, since the pool's processes outlive a job)."""
    decoder.verify_stochastic = CONTROLS[kind] if broken else verify_stochastic
    return sample_two_tokens(load(paths[0]), load(paths[1]), SPECS[kind], n, seed)


def sample_in_parallel(pool, paths, kind: str, n: int, seed: int, broken: bool = False):
    """sample_two_tokens's n samples drawn as independent streams (seeds (seed, i); tests/streams.py)."""
    jobs = [pool.submit(_worker, paths, kind, m, seed * 1000 + i, broken) for i, m in enumerate(shares(n))]
    parts = [j.result() for j in jobs]
    return sum(c for c, _ in parts), np.concatenate([a for _, a in parts])


def probs_after(model, ids):
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))[-1]
    return logits_to_probs(logits, PARAMS).double().cpu()


def exact_joint(target, ids):
    """P(x1, x2 | ids) for the target, by enumeration."""
    p1 = probs_after(target, ids).numpy()
    return np.concatenate([p1[a] * probs_after(target, ids + [a]).numpy() for a in range(V)])


def sample_two_tokens(target, draft, spec, n, seed):
    """n draws of the first two tokens after PROMPT + [ROOT], each from the same state; and how
    many nodes each first step accepted."""
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    dec = SpeculativeDecoder(target, draft, spec, PARAMS, torch.Generator().manual_seed(seed), 64)
    dec.prefill(PROMPT, 64)
    base_t, base_d = dec.target_cache.length, dec.draft_cache.length
    samples, accepted = [], []
    for _ in range(n):
        out, r = [], ROOT
        while len(out) < 2:
            step = dec.step(r)
            if not out:
                accepted.append(len(step.tokens) - 1)
            out += step.tokens
            r = step.tokens[-1]
        samples.append(out[0] * V + out[1])
        dec.target_cache.truncate(base_t)  # back to the same state for the next sample
        dec.draft_cache.truncate(base_d)
    return np.bincount(samples, minlength=V * V).astype(float), np.array(accepted)


def chi_square_p(counts, exact):
    """p-value of counts against exact, cells with expected count under 5 pooled into one."""
    n = counts.sum()
    if counts[exact == 0].sum():
        return 0.0  # something the target cannot produce
    big = exact * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exact[big], exact[~big].sum()) * n
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def p_values(counts, exact) -> dict[str, float]:
    """The first token's marginal and the 2-token joint, each against the exact distribution."""
    return {"first": chi_square_p(counts.reshape(V, V).sum(1), exact.reshape(V, V).sum(1)),
            "joint": chi_square_p(counts, exact)}


def test_every_stochastic_tree_kind_is_tested_and_has_a_control():
    """A tree kind added to the decoder fails here until it has a distribution test and a control."""
    assert set(SPECS) == set(CONTROLS) == set(CONTROL_BIAS) == set(SAMPLES) == set(TREE_KINDS) - {"none"}


def test_the_fixture_spreads_and_partly_agrees(models):
    target, draft = models
    p, q = probs_after(target, PROMPT + [ROOT]), probs_after(draft, PROMPT + [ROOT])
    assert p.max() < 0.3 and (p > 0.02).sum() >= 6  # spread over the vocabulary
    assert 0.5 < float(torch.minimum(p, q).sum()) < 0.9  # partial agreement at the root


def test_sample_sizes_give_the_power_written_down():
    for kind, (statistic, w) in CONTROL_BIAS.items():
        df = V - 1 if statistic == "first" else 60  # about 60 joint cells keep an expected count >= 5
        critical = stats.chi2.ppf(1 - ALPHA / 2, df)
        power = stats.ncx2.sf(critical, df, SAMPLES[kind] * w * w)
        assert power >= MIN_POWER, f"{kind}: power {power:.3f} with {SAMPLES[kind]} samples"


@pytest.mark.parametrize("kind", list(SPECS))
def test_first_two_tokens_after_a_state_have_the_target_distribution(models, paths, pool, kind):
    target, _ = models
    counts, accepted = sample_in_parallel(pool, paths, kind, SAMPLES[kind], seed=17)
    assert counts.sum() == SAMPLES[kind]
    depth = SPECS[kind].depth
    partial = ((accepted >= 1) & (accepted <= depth - 2)).mean()
    assert partial >= 1 / 3, f"{kind}: only {partial:.2f} of steps accepted part of a path"
    p = p_values(counts, exact_joint(target, PROMPT + [ROOT]))
    assert min(p.values()) > ALPHA / 2, p


@pytest.mark.parametrize("kind", list(SPECS))
def test_a_broken_verifier_fails_the_same_test(models, paths, pool, kind):
    """Negative control: the decoder with its verifier broken as CONTROLS says must be rejected."""
    target, _ = models
    counts, _ = sample_in_parallel(pool, paths, kind, SAMPLES[kind], seed=17, broken=True)
    p = p_values(counts, exact_joint(target, PROMPT + [ROOT]))
    assert min(p.values()) < ALPHA / 2, p


# ---- with adaptation on --------------------------------------------------------------------------

# (plain checks every 40 tree steps: they run, between trees, without making the plain steps so
# many that the control's bias is diluted; the timing evidence is frozen below, so every check
# waits PLAIN_CHECK_FIRST)
# (LONG_RATE 1: each sample is an answer of one or two steps, and the next one starts from its
# evidence whole, so that the trees keep switching as they did with one estimate across answers)
ADAPT_CONSTANTS = {"EVERY": 1, "HYSTERESIS": 0.0, "PRIOR_NODES": 1.0, "GEN_PRIOR": 1.0, "LONG_RATE": 1.0,
                   "ACCEPT_FORGET": 0.5, "PROBE_EVERY": 2, "REPLAN_SHARE": 100.0, "PLAIN_CHECK_FIRST": 40,
                   "PLAIN_CHECK_EVERY": 40}


def sample_two_tokens_adaptive(target, draft, n, seed):
    """As sample_two_tokens, but each step's tree is chosen by a real OnlinePlanner from what the
    steps before it verified and measured (its state carries over from sample to sample; its
    constants set so that it switches all the time). The timings it starts from make trees barely
    pay (a level costs 0.3 of a pass), so that each step's evidence tips the choice. Returns the
    counts, the trees used, and how many samples switched tree between their two steps."""
    from collections import Counter

    from offload_engine.planning import adaptive
    from sequoia_trees.dp import TreeTable
    from sequoia_trees.optimizer import Candidates, Timings
    for name, value in ADAPT_CONSTANTS.items():
        setattr(adaptive, name, value)
    # the timing evidence is frozen: these tiny models' real timings (a draft level costing
    # about a pass) would make plain decoding win nearly always; acceptance evidence alone
    # drives the choice (timing only ever changes which tree runs, never what is verified)
    adaptive.TimingEstimate.observe = lambda *args: None
    torch.set_num_threads(1)
    base = Timings((1, 16), (1.0, 1.0), (1, 8), (0.3, 0.3))
    planner = adaptive.OnlinePlanner(SHAPE, base, Candidates(SHAPE, [2, 4, 8], 4, TreeTable(SHAPE, 8, 4)))
    dec = SpeculativeDecoder(target, draft, TreeSpec(), PARAMS, torch.Generator().manual_seed(seed), 64,
                             max_nodes=8, timed=True)
    dec.prefill(PROMPT, 64)
    lengths = [len(q.tokens) for q in dec.seqs]
    samples, used, switched = [], Counter(), 0
    for _ in range(n):
        dec.set_spec(planner.begin())
        out, r, trees = [], ROOT, []
        while len(out) < 2:
            trees.append(dec.spec.shape())
            step = dec.step(r)
            nxt = planner.record(dec.spec, step.verify, dec.last_times, not out)
            if nxt is not None:
                dec.set_spec(nxt)
            out += step.tokens
            r = step.tokens[-1]
        used.update(len(t) for t in trees)
        switched += len(set(trees)) > 1
        samples.append(out[0] * V + out[1])
        for q, length in zip(dec.seqs, lengths):  # back to the same state for the next sample
            q.cache.truncate(length)
            del q.tokens[length:]
    return np.bincount(samples, minlength=V * V).astype(float), used, switched


def _adaptive_worker(paths, n: int, seed: int, broken: bool):
    decoder.verify_stochastic = CONTROLS["sequoia"] if broken else verify_stochastic  # (see _worker)
    return sample_two_tokens_adaptive(load(paths[0]), load(paths[1]), n, seed)


def _adaptive_in_parallel(pool, paths, n, seed, broken=False):
    jobs = [pool.submit(_adaptive_worker, paths, m, seed * 1000 + i, broken) for i, m in enumerate(shares(n))]
    parts = [j.result() for j in jobs]
    return sum(c for c, _, _ in parts), sum((u for _, u, _ in parts), start=__import__("collections").Counter()), \
        sum(s for _, _, s in parts)


def test_first_two_tokens_with_the_tree_re_chosen_every_step_have_the_target_distribution(models, paths, pool):
    target, _ = models
    n = SAMPLES["sequoia"]
    counts, used, switched = _adaptive_in_parallel(pool, paths, n, seed=23)
    assert counts.sum() == n
    # not degenerate: plain steps, trees of two sizes, and samples switching tree between their two
    # steps; and most steps speculate, so that the control's bias is not diluted by plain steps
    # (at 0.35 a level, with about 15% plain steps, the control once gave p = 5.6e-5, just short
    # of rejection). Measured in two 400-sample runs at 0.3: (8, 4) 428 and 433 steps, (4, 3) 28
    # and 27, plain 16 and 8; 42 and 36 samples switching
    assert used[1] >= n / 100 and used[4] >= n / 40 and used[8] >= 0.8 * n, used
    assert switched >= n / 20, switched
    p = p_values(counts, exact_joint(target, PROMPT + [ROOT]))
    assert min(p.values()) > ALPHA / 2, p


def test_a_broken_verifier_fails_the_adaptive_test(models, paths, pool):
    target, _ = models
    counts, _, _ = _adaptive_in_parallel(pool, paths, SAMPLES["sequoia"], seed=23, broken=True)
    p = p_values(counts, exact_joint(target, PROMPT + [ROOT]))
    assert min(p.values()) < ALPHA / 2, p


# ---- suffix drafts: fixed proposals, alone and grafted onto the model's tree ----------------------

# Earlier text the suffix draft reads: after "1 5 2 3" (the test state) it continued in several
# ways, some the target likes and some it does not, so that a step accepts part of its tree.
STORE_SEQS = [[1, 5, 2, 3, 0, 4, 6, 1], [1, 5, 2, 3, 0, 4, 6, 2], [1, 5, 2, 3, 0, 7, 1, 5], [1, 5, 2, 3, 6, 2, 5, 0],
              [1, 5, 2, 3, 6, 2, 4, 3], [1, 5, 2, 3, 4, 4, 0, 7], [2, 3, 0, 4, 6, 1, 1, 5], [5, 2, 3, 7, 7, 0, 2, 6]]
SUFFIX_KINDS = {"suffix": None, "hybrid": SPECS["sequoia"]}


def _fixed_as_drawn(parents, tokens, target_probs, draft_probs, *args, fixed=frozenset(), **kw):
    """The bug of a decoder that forgets its suffix nodes are fixed proposals: they are verified
    as if drawn from the draft's distribution (uniform where the draft has no row)."""
    q = torch.full((len(parents), V), 1.0 / V, dtype=target_probs.dtype)
    if draft_probs is not None:
        q[:draft_probs.shape[0]] = draft_probs
    return verify_stochastic(parents, tokens, target_probs, q, *args, **kw)


# kind: (the statistic the control's bias shows in, its effect size w measured with 4,000 samples)
# (measured: suffix 2.59 on the first token, hybrid 1.36 on the joint, pooled as the test pools 1,500)
SUFFIX_CONTROL_BIAS = {"suffix": ("first", 2.59), "hybrid": ("joint", 1.36)}
SUFFIX_SAMPLES = {"suffix": 1500, "hybrid": 1500}


def sample_two_tokens_suffix(target, draft, spec, n, seed):
    """As sample_two_tokens, with a suffix drafter reading STORE_SEQS (alone when draft is None,
    grafted onto the draft's tree otherwise); also how many suffix nodes each first step accepted."""
    from offload_engine.speculation.suffix import SuffixDrafter
    torch.set_num_threads(1)
    store = np.array(sum(([*s, -1] for s in STORE_SEQS), []), dtype=np.int32)
    drafter = SuffixDrafter(PROMPT, store, 65)
    dec = SpeculativeDecoder(target, draft, spec or TreeSpec(), PARAMS, torch.Generator().manual_seed(seed), 64,
                             suffix=drafter)
    dec.prefill(PROMPT, 64)
    lengths = [len(q.tokens) for q in dec.seqs]
    samples, accepted, from_suffix = [], [], []
    for _ in range(n):
        out, r = [], ROOT
        while len(out) < 2:
            before = dec.suffix_accepted
            step = dec.step(r)
            if not out:
                accepted.append(len(step.tokens) - 1)
                from_suffix.append(dec.suffix_accepted - before)
            out += step.tokens
            r = step.tokens[-1]
        samples.append(out[0] * V + out[1])
        for q, length in zip(dec.seqs, lengths):  # back to the same state for the next sample
            q.cache.truncate(length)
            del q.tokens[length:]
        drafter.truncate(len(PROMPT))
    return np.bincount(samples, minlength=V * V).astype(float), np.array(accepted), np.array(from_suffix)


def _suffix_worker(paths, kind: str, n: int, seed: int, broken: bool):
    decoder.verify_stochastic = _fixed_as_drawn if broken else verify_stochastic  # (see _worker)
    draft = load(paths[1]) if kind == "hybrid" else None
    return sample_two_tokens_suffix(load(paths[0]), draft, SUFFIX_KINDS[kind], n, seed)


def _suffix_in_parallel(pool, paths, kind, n, seed, broken=False):
    jobs = [pool.submit(_suffix_worker, paths, kind, m, seed * 1000 + i, broken) for i, m in enumerate(shares(n))]
    parts = [j.result() for j in jobs]
    return (sum(c for c, _, _ in parts), np.concatenate([a for _, a, _ in parts]),
            np.concatenate([f for _, _, f in parts]))


@pytest.mark.parametrize("kind", list(SUFFIX_KINDS))
def test_first_two_tokens_with_suffix_drafts_have_the_target_distribution(models, paths, pool, kind):
    """Suffix-only trees (every node a fixed proposal) and hybrid trees (the draft's Sequoia tree
    with the suffix paths it did not propose grafted on): same test and threshold as the kinds above."""
    target, _ = models
    n = SUFFIX_SAMPLES[kind]
    counts, accepted, from_suffix = _suffix_in_parallel(pool, paths, kind, n, seed=29)
    assert counts.sum() == n
    # not degenerate: first steps that accept some nodes but not all, and suffix nodes accepted
    # (measured with 4,000 samples: 0.33 and 0.33 for suffix, 0.74 and 0.12 for hybrid)
    assert ((accepted >= 1) & (accepted <= 2)).mean() >= 0.2, np.bincount(accepted)
    assert (from_suffix >= 1).mean() >= 0.06, np.bincount(from_suffix)
    p = p_values(counts, exact_joint(target, PROMPT + [ROOT]))
    assert min(p.values()) > ALPHA / 2, p


@pytest.mark.parametrize("kind", list(SUFFIX_KINDS))
def test_suffix_nodes_verified_as_drawn_fail_the_same_test(models, paths, pool, kind):
    target, _ = models
    counts, _, _ = _suffix_in_parallel(pool, paths, kind, SUFFIX_SAMPLES[kind], seed=29, broken=True)
    p = p_values(counts, exact_joint(target, PROMPT + [ROOT]))
    assert min(p.values()) < ALPHA / 2, p


def test_suffix_sample_sizes_give_the_power_written_down():
    for kind, (statistic, w) in SUFFIX_CONTROL_BIAS.items():
        df = V - 1 if statistic == "first" else 60
        power = stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA / 2, df), df, SUFFIX_SAMPLES[kind] * w * w)
        assert power >= MIN_POWER, f"{kind}: power {power:.3f} with {SUFFIX_SAMPLES[kind]} samples"


# A draft on the target's own KV cache (a substitute self-draft's way, `shares_cache`) whose next
# trees are grown ahead for the likeliest ends of each step and used when their case comes
# (overlap "eager": all of that before the pass, as a pass with time for it would). A tree grown
# ahead serves the step after a step that accepted a path, so the test reads four tokens: the
# first two's joint (as above) and the third and fourth's joint, whose steps often started from
# a tree grown ahead, each against the target's exact distribution by enumeration. Its control
# breaks the verifier as for sequoia. Its effect size on the first two's joint, measured on this
# configuration with 2,000 samples: w = 0.49, where a correct run measured 0.19 (the noise of
# 2,000 samples, about sqrt(60 / 2000) = 0.17), so a bias of sqrt(0.49^2 - 0.19^2) = 0.45. (A
# control more specific to trees grown ahead was tried and dropped: a decoder that uses a tree
# grown ahead whatever the bonus token, so that the tree's root is the wrong token, biases this
# fixture's later tokens too weakly to be found reliably with these sample sizes; this 1-layer,
# 8-token model's next token depends little on one token of context. The greedy test that a tree
# grown ahead equals a fresh one, tests/test_substitute_draft.py, covers what the trees hold.)
# The same run: 36% of correct samples had a later step start from a tree grown ahead.
SHARED_CONTROL_BIAS = ("joint", 0.45)
SHARED_SAMPLES = 600


def sample_four_tokens_shared(target, draft, spec, n, seed, overlap="eager"):
    """n draws of the first four tokens after PROMPT + [ROOT], the draft sharing the target's
    cache and growing ahead: (counts of the first two, counts of the 3rd and 4th, per sample
    whether a step after the first started from a tree grown ahead)."""
    torch.set_num_threads(1)
    draft.shares_cache = True
    dec = SpeculativeDecoder(target, draft, spec, PARAMS, torch.Generator().manual_seed(seed), 64, overlap=overlap)
    dec.prefill(PROMPT, 64)
    base = dec.target_cache.length
    first, later, ahead = [], [], []
    for _ in range(n):
        out, r, used = [], ROOT, 0
        while len(out) < 4:
            step = dec.step(r)
            used += bool(out) and dec.last_times.ahead_levels > 0
            out += step.tokens
            r = step.tokens[-1]
        first.append(out[0] * V + out[1])
        later.append(out[2] * V + out[3])
        ahead.append(used)
        dec.target_cache.truncate(base)  # back to the same state for the next sample
        del dec.seqs[0].tokens[base:]
        dec.forget_ahead()
    count = lambda xs: np.bincount(xs, minlength=V * V).astype(float)  # noqa: E731
    return count(first), count(later), np.array(ahead)


def exact_later_joint(target, ids):
    """P(x3, x4 | ids) for the target: the joint of the next two after every (x1, x2)."""
    first = exact_joint(target, ids)
    return sum(first[a * V + b] * exact_joint(target, ids + [a, b]) for a in range(V) for b in range(V))


def _shared_worker(paths, n: int, seed: int, broken: bool):
    decoder.verify_stochastic = CONTROLS["sequoia"] if broken else verify_stochastic  # (see _worker)
    decoder.AHEAD_JOBS, decoder.AHEAD_GUESSES, decoder.AHEAD_WIDTH = 16, 4, 64  # the likeliest cases, whole
    return sample_four_tokens_shared(load(paths[0]), load(paths[1]), SPECS["sequoia"], n, seed)


def _shared_in_parallel(pool, paths, n, seed, broken=False):
    jobs = [pool.submit(_shared_worker, paths, m, seed * 1000 + i, broken) for i, m in enumerate(shares(n))]
    parts = [j.result() for j in jobs]
    return (sum(c for c, _, _ in parts), sum(c for _, c, _ in parts), np.concatenate([h for _, _, h in parts]))


def _shared_p_values(target, first, later) -> dict[str, float]:
    ids = PROMPT + [ROOT]
    return {"joint": chi_square_p(first, exact_joint(target, ids)),
            "later joint": chi_square_p(later, exact_later_joint(target, ids))}


def test_four_tokens_with_a_shared_cache_and_trees_grown_ahead_have_the_target_distribution(models, paths, pool):
    target, _ = models
    first, later, ahead = _shared_in_parallel(pool, paths, SHARED_SAMPLES, seed=31)
    assert first.sum() == later.sum() == SHARED_SAMPLES
    # not degenerate: samples in which a later step started from a tree grown ahead (0.36 measured)
    assert (ahead >= 1).mean() >= 0.2, np.bincount(ahead)
    p = _shared_p_values(target, first, later)
    assert min(p.values()) > ALPHA / 2, p


def test_a_broken_verifier_fails_the_shared_cache_test(models, paths, pool):
    target, _ = models
    first, later, _ = _shared_in_parallel(pool, paths, SHARED_SAMPLES, seed=31, broken=True)
    p = _shared_p_values(target, first, later)
    assert min(p.values()) < ALPHA / 2, p


def test_shared_cache_sample_size_gives_the_power_written_down():
    statistic, w = SHARED_CONTROL_BIAS
    df = V - 1 if statistic == "first" else 60
    power = stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA / 2, df), df, SHARED_SAMPLES * w * w)
    assert power >= MIN_POWER, f"power {power:.3f} with {SHARED_SAMPLES} samples"
