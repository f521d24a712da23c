"""Online re-planning for `--tree auto`: the profile and the stored vector are the start, each
step's measurements the truth (SmartSpec's per-step choice from measured goodput, on top of
Sequoia's optimal trees).

After every speculation step the planner records what the step measured:
  * the acceptance evidence: along the accepted path, each node with children either accepted
    its child of rank r (ranks 0..r-1 were tried and rejected) or had all its k children
    rejected. `AcceptanceEstimate` turns these into the hazard of each rank (the chance rank r
    is accepted when ranks below it were not) on two levels. Within an answer, a Beta posterior
    per rank whose prior is the pair's estimate counted as GEN_PRIOR observations; the answer's
    evidence and that prior fade by ACCEPT_FORGET per tree step, so an answer that turns from
    chat to code is followed. The pair's estimate starts as the stored or measured vector and
    moves LONG_RATE of the way to each answer's at its end: a long answer weighs no more than
    a few (a short one less: its own hazards are still near the pair's), and one hard prompt
    does not set the trees of the next;
  * the timing evidence: the draft's part of the step and the target's (its pass, the
    verification, the commits), each against what the profile's step model predicts for that
    tree. `TimingEstimate` keeps one factor for each, the median of the last WINDOW steps'
    measured / predicted (the prior, 1, fills the window's first PRIOR_STEPS places while it is
    short): a disk that slows down is followed within a few steps, and one freak step (a graph
    capture, a page-cache miss) moves nothing. Plain steps inform the target's factor.
Every EVERY steps the planner re-chooses (budget, depth) among the optimizer's precomputed
candidates (`optimizer.Candidates`) under the updated timings. It fills the DP table again
only when the acceptance estimate has moved by more than REFILL_DISTANCE (L1) or the tree it
weighs is worth REFILL_VALUE more or less under it (a draft that agrees 95% of the time moves
little in L1 and much in worth), up to twice the current budget (the larger candidates kept as
they were), and only when the refill's predicted cost keeps all re-planning under REPLAN_SHARE
of the decoding time so far (counted across generations), but for a fill up to START_FILL
between answers, which always runs: an answer starts from the pair's estimate. It switches only
when the new choice is predicted HYSTERESIS faster than the current one under the same model (no
flapping), but for plain decoding, taken from a tree as soon as it is predicted faster (a useless
draft's small tree, 5% slower than plain, was kept for the margin; the way back to a tree needs
the whole margin). When plain decoding wins, a step after
PROBE_EVERY plain ones runs the best tree anyway, so that the evidence that would bring the
tree back keeps coming; each probe after which plain decoding stays chosen doubles the wait (up
to PROBE_MAX steps), so that a draft that does not pay costs little. The other way round, while
a tree is chosen, a plain check of PLAIN_CHECK_STEPS plain step runs every PLAIN_CHECK_FIRST
tree steps until PLAIN_CHECK_SAMPLES plain steps are timed, and then every PLAIN_CHECK_EVERY while
the tree is predicted less than PLAIN_CHECK_BELOW times as fast as plain decoding (where an error
in plain's prediction could change the choice): plain decoding's time is measured rather than
carried over from the trees' steps (a tree's pass on the 2-vCPU machine cost 1.2x a plain one
where the profile said 1.09x, so plain decoding predicted from the trees' factor was 25-30% slow,
2026-12-02), and it is what every choice is weighed against. The first checks run however fast
the tree is predicted, so that a run's speed-up over plain decoding always stands on plain steps
it measured itself (the demo's line, 2026-12-03, had stood on the profile's plain time: 2.5x
shown, 1.7-2.1x against plain decoding measured on its own), and on the median of several spread
over the run (one plain step of the demo took 0.49 s where its neighbours' took 0.13-0.15: a disk
stall, and 5.8x printed); they cost a few plain steps per planner. `demo` turns them off
(`first_checks`) and times plain decoding after its answer instead: in its one short answer the
checks were 2 of 7 steps, and the median of 8 steps timed apart is the steadier yardstick.

With suffix drafts grafted on (`--draft X+suffix`), each step also chooses, before it runs, among
the planner's tree alone ("model": plain decoding when that is the choice), the suffix proposal
alone ("suffix": no draft levels, the draft catching up later) and both ("hybrid"), by predicted
seconds per token: the profile's step model for the costs, and for the suffix proposal's worth a
`SuffixEstimate` by match length, learned from every step's output.

With suffix drafts alone (`--draft suffix`, no model), a `SuffixGate` weighs each proposal the
same way against plain decoding, its costs measured from the steps themselves (there is no draft
to profile), and runs it whole, trimmed to its most probable nodes, or not at all.

The generation's length counts too (`optimizer`'s docstring): `begin(length)` gives the tokens
the steps are to make (max_new_tokens less the prefill's token), every choice is for the tokens
still left (a deep tree's last step in a short answer throws away what it accepted past the
end), and once fewer are left than TAIL steps of the current tree would make, the planner
re-plans after every step (the last few tokens may be cheaper plainly or from a smaller tree).
Each step's forecast is the tokens it is expected to hand out, E[min(X, left)], and what it
measured is the tokens it did hand out. The length is max_new_tokens, unless earlier answers
say that answers end sooner with their end-of-sequence token: once LENGTH_MIN of the last
LENGTH_WINDOW answers that ended on their own (`finish`) are longer than this one so far, the
tokens left are taken as the median of what those had left, capped by max_new_tokens
(`planning_length`); an answer longer than all of them goes back to max_new_tokens. What was
learned is kept from one run to the next (`learned`). The forecast keeps to max_new_tokens, the only bound a step cannot pass.

A planner belongs to one request temperature (greedy and sampled requests never share one);
what it learned carries over from one generation to the next.

Exactness: a step's tree is chosen before that step's target pass, from what earlier steps
verified and measured; verification is exact for any tree, so the output is the target's
(greedy: plain greedy decoding; sampled: the target's distribution).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from sequoia_trees.acceptance import AcceptanceVector, path_evidence, tried_ranks, vector_from_hazards
from sequoia_trees.dp import TreeTable, tree_value
from sequoia_trees.optimizer import Candidates, Choice, Timings
from sequoia_trees.verify import VerifyResult

from ..speculation.decoder import StepTimes, TreeSpec
from ..speculation.suffix import SuffixProposal

PRIOR_NODES = 8.0  # the prior vector counts as this many observed nodes in the pair's counts (at first)
ACCEPT_FORGET = 0.97  # per tree step within an answer: evidence 35 steps old weighs a third
# at an answer's start the pair's hazards count as this many observed nodes (fading with the
# answer's evidence). As a Beta prior it is worth p(1 - p) / var - 1 nodes, var the spread of the
# first rank's acceptance from prompt to prompt: `benchmarks/prompt_spread.py` found none beyond
# chance (tau 0 by maximum likelihood, at most 0.50-0.65 on the log-odds at 90%; self-q8 at T=0
# and T=0.6, the default draft at T=0, 2026-12-06/07), which at the upper ends is 70-95 nodes.
# At 16 (until 2026-12-07) two early rejections in 34 tries moved the demo's answer off (16, 16)
# in 14 of 15 runs and made it 10% slower than keeping it (0.045 against 0.041 s/token, five runs
# each, interleaved), and the hard first prompt of the latency benchmark's shifting set (40/42
# at rank 1 where the others read 42/42-44/45) set its trees wandering
GEN_PRIOR = 64.0
# ... but a draft that an answer shows to be nothing like the pair's hazards (a stored vector
# of another draft, a prompt in a language the draft never saw) must not take 64 nodes to be
# believed: the answer's prior is a mixture, GEN_PRIOR's Beta with the chance 1 - GEN_UNLIKE and
# a Beta worth GEN_WEAK nodes with the chance GEN_UNLIKE, each rank's components weighed by how
# well they predicted the answer's evidence (their Beta-binomial likelihoods). Evidence that
# chance explains (the demo's 2 rejections in 34 tries against a 3.3% prior) keeps the strong
# one; 5 rejections in 5 tries of a rank the pair accepts 90% of the time turn it to the weak one
GEN_WEAK = 2.0
GEN_UNLIKE = 0.05
# each answer moves the pair's hazards this much of the way to its own (the last few answers
# weigh most). Until 2026-12-05 one estimate ran across answers, each node one observation: a
# hard first prompt (self-q8 at T=0, 8 rejections in about 100 nodes) put the next answers on
# (8, 8) trees whose every step was accepted whole, where (24, 20) made 19.5 tokens a step
LONG_RATE = 0.25
# the at-risk count the pair's hazards are held with once an answer has moved them: the prior's
# anchor then weighs 1/33 of a hazard (with the prior's 8 it confined each hazard within
# h_prior / 9 and (8 + h_prior) / 9: a draft the prior rates at 0.9 could never be taken under 0.1)
PAIR_NODES = 32.0
PRIOR_STEPS = 3  # the profile's timings fill this many places of a short window
WINDOW = 7  # steps whose median ratio is a timing factor
EVERY = 4  # steps between re-plans
HYSTERESIS = 0.05  # a new tree must be predicted this much faster
PROBE_EVERY = 12  # plain steps before the first probe of the best tree
PROBE_MAX = 48  # probes that keep plain decoding chosen double the wait up to this
PLAIN_CHECK_STEPS = 1  # plain steps per check (a plain step is timed on its first use too)
PLAIN_CHECK_FIRST = 2  # tree steps before the first check (and between the first checks)
PLAIN_CHECK_SAMPLES = 3  # plain steps timed by the first checks, whatever the tree's predicted speed-up
PLAIN_CHECK_EVERY = 48  # tree steps between later checks
PLAIN_CHECK_BELOW = 2.0  # checks only while the tree is predicted less than this much faster than plain
TAIL = 2.0  # re-plan after every step once fewer tokens are left than this many steps of the tree's
LENGTH_WINDOW = 16  # answers that ended on their own whose lengths predict the next one's
# ... used once at least this many of them are longer than the answer so far (one: a length seen
# once is a better guess than max_new_tokens, which is a cap; an answer that outgrows every one of
# them goes back to max_new_tokens. Three, until 2026-12-05, left a new chat's first three answers,
# and the demo's first three runs, planned for 128 tokens where they made 67)
LENGTH_MIN = 1
REFILL_DISTANCE = 0.04  # L1 change of the acceptance estimate that refills the DP table
# ... or this relative change of what the tree re-planning weighs (the current one; on plain
# decoding the best tree) is worth under the estimate against the table's vector. A draft that
# agrees 95% of the time moves little in L1 and much in worth: self-q8 at T=0 read 0.937 for rank 1
# in the table and 0.956 in the pair's estimate, an L1 of 0.038, and (8, 8) under the first, 10%
# of its worth, where (16, 13) was best under the second (2026-12-07)
REFILL_VALUE = 0.05
REPLAN_SHARE = 0.03  # of the decoding time, at most, spent re-planning
# ... but between answers the table is always refilled up to this budget (or the last answer's
# first tree's, if wider) where the pair's estimate moved (10-20 ms on the 2-vCPU machine up to
# 32; a streamed 70B pass costs seconds): an answer starts from the pair's hazards, not from a
# table left at the last answer's worst moment. With the share spent
# by a hard first prompt's re-plans (self-q8 at T=0, the latency benchmark's shifting set), the
# next answer had started on (8, 7) from a table filled at 0.898 for rank 1 where the pair's
# estimate read 0.956, for which (16, 13) was best (2026-12-07)
START_FILL = 32
REFILL_SECONDS_PER_UNIT = 5e-9  # a first guess of a DP refill's cost per n^2 * depth * width (measured after)


def expected_length(ended, done: int, left: int | None) -> int | None:
    """The tokens an answer's steps are expected to make still, `done` made and at most `left`
    allowed (None: unbounded): the median of what the kept lengths of answers that ended on their
    own (`ended`) had left, once LENGTH_MIN of them are longer than `done`, capped by `left`;
    else `left`."""
    longer = [n - done for n in ended if n > done]
    if len(longer) < LENGTH_MIN:
        return left
    expected = max(1, int(statistics.median(longer)))
    return expected if left is None else min(left, expected)


def _beta_binomial_log(accepted: float, tried: float, alpha: float, beta: float) -> float:
    """log P(`accepted` of `tried` | a Beta(alpha, beta) rate), less the binomial coefficient
    (the same for every prior, so a ratio of two needs none); fractional counts (faded evidence)
    are taken as they are."""
    return (math.lgamma(accepted + alpha) + math.lgamma(tried - accepted + beta) - math.lgamma(tried + alpha + beta)
            - math.lgamma(alpha) - math.lgamma(beta) + math.lgamma(alpha + beta))


class AcceptanceEstimate:
    """The acceptance vector from a prior and observed paths, on two levels: the pair's (what this
    draft does on this user's prompts, from answer to answer) and this answer's.

    Per rank r, the hazard h_r = P(rank r accepted | ranks < r rejected). The pair's hazards are
    counts anchored to the prior vector (worth PRIOR_NODES observations at first, then one in
    PAIR_NODES + 1: `pair_hazards`); they move once per answer, at its end (`end_generation`), a
    LONG_RATE step towards what that answer measured (its own posterior: a short answer's is
    near the pair's, so it moves them less), and one hard prompt does not set the next one's trees. Within an answer, the
    answer's own evidence (decayed by ACCEPT_FORGET per step, so that an answer that turns from
    chat to code is followed) is weighed against the pair's hazards worth GEN_PRIOR observations
    at the answer's start, fading with the evidence down to one: a Beta posterior per rank
    (`hazards`). p_r = h_r * prod_{j<r} (1 - h_j)."""

    def __init__(self, prior: AcceptanceVector, strength: float | None = None, forget: float | None = None):
        strength = PRIOR_NODES if strength is None else strength
        self.width, self.forget = prior.width, ACCEPT_FORGET if forget is None else forget
        left, self.prior_h = 1.0, []
        for p in prior.probs:
            self.prior_h.append(min(1.0, p / left) if left > 1e-12 else 0.0)
            left -= p
        # the pair's counts, the prior's pseudo-observations included
        self.accepted = [strength * h for h in self.prior_h]
        self.at_risk = [strength] * self.width
        # this answer's evidence (decayed counts)
        self.gen_accepted = [0.0] * self.width
        self.gen_at_risk = [0.0] * self.width
        self.gen_prior = GEN_PRIOR  # what the pair's hazards weigh in this answer (fading)
        self.steps = 0  # tree steps observed (restored ones included: `learned`)

    def restore(self, prior_h: list[float], accepted: list[float], at_risk: list[float], steps: int) -> None:
        """Go on from an earlier estimate's state (`planning.learned`): its anchor (the stored
        prior's hazards) and its pair counts (saved between answers: no answer's evidence open)."""
        if not len(prior_h) == len(accepted) == len(at_risk) == self.width:
            raise ValueError(f"an estimate of width {self.width} cannot take a state of width {len(accepted)}")
        self.prior_h, self.accepted, self.at_risk = list(prior_h), list(accepted), list(at_risk)
        self.gen_accepted, self.gen_at_risk = [0.0] * self.width, [0.0] * self.width
        self.gen_prior = GEN_PRIOR
        self.steps = int(steps)

    def observe(self, children: int, rank: int | None) -> None:
        """A node with `children` children whose child of 0-based `rank` was accepted (None:
        every child rejected)."""
        for r in range(tried_ranks(children, rank, self.width)):
            self.gen_at_risk[r] += 1.0
        if rank is not None and rank < self.width:
            self.gen_accepted[rank] += 1.0

    def fade(self) -> None:
        """Once per step: this answer's older evidence weighs less."""
        self.gen_accepted = [a * self.forget for a in self.gen_accepted]
        self.gen_at_risk = [n * self.forget for n in self.gen_at_risk]
        self.gen_prior = max(1.0, self.gen_prior * self.forget)
        self.steps += 1

    def pair_hazards(self) -> list[float]:
        """The pair's hazards: what a new answer starts from."""
        return [(a + h) / (n + 1.0) for a, n, h in zip(self.accepted, self.at_risk, self.prior_h)]

    def hazards(self) -> list[float]:
        """This answer's posterior hazards: per rank the mixture of a Beta prior at the pair's
        hazard worth GEN_PRIOR nodes and one worth GEN_WEAK (both fading as the answer's evidence
        does, the weak one never more than the other), weighed by their chance (1 - GEN_UNLIKE,
        GEN_UNLIKE) times how likely each made the answer's evidence (the constants' comment)."""
        strong = self.gen_prior
        weak = min(strong, GEN_WEAK * strong / GEN_PRIOR)  # (both fade with the answer's evidence)
        out = []
        for a, n, h in zip(self.gen_accepted, self.gen_at_risk, self.pair_hazards()):
            mean_strong = (a + strong * h) / (n + strong)
            if n <= 0.0 or weak >= strong:
                out.append(mean_strong)
                continue
            mean_weak = (a + weak * h) / (n + weak)
            # (the weak component's posterior weight, from the log-likelihood ratio; a hazard of 0
            # or 1 held just inside, where a Beta has no density)
            hc = min(max(h, 1e-6), 1.0 - 1e-6)
            lr = _beta_binomial_log(a, n, weak * hc, weak * (1 - hc)) - _beta_binomial_log(
                a, n, strong * hc, strong * (1 - hc))
            x = math.log(GEN_UNLIKE / (1.0 - GEN_UNLIKE)) + lr
            p_weak = 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0
            out.append((1.0 - p_weak) * mean_strong + p_weak * mean_weak)
        return out

    def end_generation(self) -> None:
        """An answer's end: the pair's hazards move LONG_RATE of the way to this answer's (ranks it
        saw no evidence for stay), and the answer's evidence is closed. (A hazard is held within
        h_prior / (n + 1) and (n + h_prior) / (n + 1), n its at-risk count: raised to PAIR_NODES
        by the first move, so that the prior's anchor weighs little.)"""
        if not any(self.gen_at_risk):
            return
        now = self.hazards()
        for r, (h_pair, h_gen) in enumerate(zip(self.pair_hazards(), now)):
            if self.gen_at_risk[r] <= 0.0:
                continue
            target = (1.0 - LONG_RATE) * h_pair + LONG_RATE * h_gen
            n = self.at_risk[r] = max(self.at_risk[r], PAIR_NODES)
            self.accepted[r] = min(n, max(0.0, target * (n + 1.0) - self.prior_h[r]))
        self.gen_accepted, self.gen_at_risk = [0.0] * self.width, [0.0] * self.width
        self.gen_prior = GEN_PRIOR

    def vector(self) -> AcceptanceVector:
        return vector_from_hazards(self.hazards())


class TimingEstimate:
    """Factors on the profile's step model, learned from measured steps: `target` multiplies the
    target's part of a tree step (its pass over n nodes plus the step's constant and per-node
    terms), `draft` the draft's levels, each the median of the last WINDOW tree steps' measured /
    predicted, the prior (1) filling the first PRIOR_STEPS places while fewer steps are in;
    `plain` a plain step, the median of the last WINDOW plain steps' (none: the target's factor
    stands in for it)."""

    def __init__(self, base: Timings):
        self.base = base
        self._ratios = {"target": deque(maxlen=WINDOW), "draft": deque(maxlen=WINDOW), "plain": deque(maxlen=WINDOW)}

    def factor(self, part: str) -> float:
        values = list(self._ratios[part])
        return statistics.median(values + [1.0] * max(0, PRIOR_STEPS - len(values)))

    def target_part(self, n: int, widths: tuple[int, ...] = ()) -> float:
        """The profile's prediction for the target's part of a tree step (n > 1; a plain step is
        `base.plain()`): `Timings.head`, its floors included (the part a measured step's
        target and rest are compared with, so that the factor learned is the one `timings()`
        applies to the same model)."""
        b = self.base
        work = b.draft_factor * sum(b.draft(w) for w in widths)
        return max(0.25 * b.target(n), b.head(n, b.overlapped(n, work)))

    def draft_part(self, n: int, widths: tuple[int, ...]) -> float:
        """The profile's prediction for the draft's part of a step before its pass: its work less
        what the pass before grew ahead (`Timings.overlapped`)."""
        work = self.base.draft_factor * sum(self.base.draft(w) for w in widths)
        return work - self.base.overlapped(n, work)

    def observe(self, n: int, widths: tuple[int, ...], times: StepTimes) -> None:
        """A plain step (n == 1) teaches plain decoding's own factor only (no prior: these steps
        are the thing itself); the trees' factors come from tree steps (while plain decoding is
        chosen, from its probes), since a tree's pass and a plain one need not move together
        (above)."""
        if n == 1:
            self._add("plain", (times.target + times.rest) / self.base.plain())
            return
        self._add("target", (times.target + times.rest) / self.target_part(n, widths))
        predicted = self.draft_part(n, widths)
        if predicted > 1e-9:  # (none when the pass before is predicted to have grown it all)
            self._add("draft", (times.draft - times.catch_up) / predicted)

    def observed(self, part: str) -> float | None:
        """The median of the ratios observed for `part` (None: none yet), without the prior."""
        values = self._ratios[part]
        return statistics.median(values) if values else None

    def _add(self, part: str, ratio: float) -> None:
        if ratio > 0 and ratio < float("inf"):
            self._ratios[part].append(ratio)

    def plain_measured(self) -> bool:
        return bool(self._ratios["plain"])

    def plain_samples(self) -> int:
        """Plain steps timed (the last WINDOW at most)."""
        return len(self._ratios["plain"])

    def timings(self) -> Timings:
        """The profile's timings with the learned factors applied; a plain step at its own
        measured factor once plain steps have been timed (else at the target's)."""
        b = self.base
        plain = b.plain() * statistics.median(self._ratios["plain"]) if self._ratios["plain"] else None
        return b.scaled(self.factor("target"), self.factor("draft"), plain)


SUFFIX_BUCKETS = (1, 3, 6, 12)  # match lengths starting each bucket: 1-2, 3-5, 6-11, 12 and more
SUFFIX_LEVELS = 8  # hazards kept per bucket (deeper levels use the last)
SUFFIX_PRIOR = 2.0  # observations the proposal's own frequency estimate counts as, per hazard
SUFFIX_FORGET = 0.98  # per observation: a bucket follows text that stops (or starts) repeating


class SuffixEstimate:
    """How far the target follows a suffix proposal, by match-length bucket: per level j, the
    hazard that the target's j-th token is one of the proposal's children at depth j given that
    its first j-1 tokens followed the proposal. A suffix node is a fixed proposal, so a suffix-only
    step would accept it exactly when the target's draw is that token: the output of any exact
    step (plain, model tree, hybrid) shows what a suffix-only step would have accepted, as far as
    it goes (a level past the step's output is not observed). The prior is the proposal's own
    frequency estimate (its depth-j nodes' probability over its depth j-1 nodes'), counted as
    SUFFIX_PRIOR observations; the evidence, fading by SUFFIX_FORGET, soon outweighs it."""

    def __init__(self):
        self.hits = [[0.0] * SUFFIX_LEVELS for _ in SUFFIX_BUCKETS]
        self.tries = [[0.0] * SUFFIX_LEVELS for _ in SUFFIX_BUCKETS]

    @staticmethod
    def bucket(match_length: int) -> int:
        return max(i for i, lo in enumerate(SUFFIX_BUCKETS) if match_length >= lo or i == 0)

    def reach(self, proposal: SuffixProposal) -> list[float]:
        """The chance that the target follows the proposal to depth 1, 2, ... (its deepest)."""
        depths = [0] * proposal.size
        mass = [1.0] + [0.0] * proposal.size  # the proposal's probability at each depth
        for i in range(1, proposal.size):
            depths[i] = depths[proposal.parents[i]] + 1
            mass[depths[i]] += proposal.probs[i]
        b, out, p = self.bucket(proposal.match_length), [], 1.0
        for j in range(max(depths)):
            k = min(j, SUFFIX_LEVELS - 1)
            prior = min(1.0, mass[j + 1] / mass[j]) if mass[j] > 0 else 0.0
            p *= (self.hits[b][k] + SUFFIX_PRIOR * prior) / (self.tries[b][k] + SUFFIX_PRIOR)
            out.append(p)
        return out

    def expected(self, proposal: SuffixProposal) -> float:
        """Expected accepted proposal tokens: the sum over its depths of the chance to get that deep."""
        return sum(self.reach(proposal))

    def observe(self, proposal: SuffixProposal, output: list[int]) -> None:
        """One step's output tokens (accepted, then the bonus) against the proposal made for it."""
        b = self.bucket(proposal.match_length)
        kids: dict[int, dict[int, int]] = {}
        for i in range(1, proposal.size):
            kids.setdefault(proposal.parents[i], {})[proposal.tokens[i]] = i
        node = 0
        for j, tok in enumerate(output):
            if node not in kids:  # the proposal ends here
                break
            k = min(j, SUFFIX_LEVELS - 1)
            self.hits[b][k] *= SUFFIX_FORGET
            self.tries[b][k] *= SUFFIX_FORGET
            self.tries[b][k] += 1
            nxt = kids[node].get(tok)
            if nxt is None:
                break
            self.hits[b][k] += 1
            node = nxt


GATE_WINDOW = 24  # recent steps of each kind the suffix gate's pass-time model is the median of
GATE_SIZES = (64, 32, 16, 8, 4, 2, 1)  # proposal sizes (nodes below the root) the gate compares


def _trimmed(proposal: SuffixProposal, k: int) -> SuffixProposal:
    """The proposal's first k nodes below the root: its most probable ones (they were added most
    probable first, a parent before its children), so still a tree."""
    if proposal.size <= k + 1:
        return proposal
    return SuffixProposal(proposal.parents[: k + 1], proposal.tokens[: k + 1], proposal.probs[: k + 1],
                          proposal.match_length, proposal.source)


class SuffixGate:
    """`--draft suffix` alone: whether a step with a suffix proposal runs it, and how much of it.

    SuffixDecoding's rule proposes up to one node per matched token, whatever a wider pass costs.
    On a GPU a pass of 64 tokens costs what a pass of one does; on a CPU it does not (here a
    disk-streamed pass of the embedded default grows by about a millisecond per token), and a
    proposal the target rarely follows then costs more than it saves. The gate compares, per step,
    plain decoding (one token, t(1)) with the proposal's k most probable nodes for k in GATE_SIZES
    (1 + the expected accepted tokens, t(1 + k)), and runs the fastest per token. Both parts are
    measured: t(n) = t1 + slope * (n - 1), t1 the median of recent plain steps, slope the median
    of recent suffix steps' (t(n) - t1) / (n - 1) (0 until one is measured: the first proposals
    run and measure it); the expected tokens come from a `SuffixEstimate` learned from every
    step's output (as with `--draft X+suffix`). One gate lives on the engine per request
    temperature, so it carries what it learned from one generation to the next.

    Exactness: the choice is made before the step's target pass, from earlier steps only, and a
    trimmed proposal is still a fixed proposal; verification is exact for any tree.
    """

    def __init__(self):
        self.suffix = SuffixEstimate()
        self.plain_times: deque[float] = deque(maxlen=GATE_WINDOW)
        self.slopes: deque[float] = deque(maxlen=GATE_WINDOW)
        self.runs = self.skips = 0

    def _model(self) -> tuple[float, float] | None:
        """(t1, slope) of the pass-time model, None before a plain step has been measured."""
        if not self.plain_times:
            return None
        slope = statistics.median(self.slopes) if self.slopes else 0.0
        return statistics.median(self.plain_times), max(0.0, slope)

    def pass_seconds(self, n: int) -> float | None:
        model = self._model()
        return None if model is None else model[0] + model[1] * (n - 1)

    def choose(self, proposal: SuffixProposal) -> tuple[str, SuffixProposal]:
        """("suffix", the proposal or its most probable part) or ("model", it): plain decoding."""
        model = self._model()
        if model is None:  # nothing measured yet: SuffixDecoding's rule
            self.runs += 1
            return "suffix", proposal
        t1, slope = model
        best, best_rate = None, 1.0 / t1
        for k in sorted({min(k, proposal.size - 1) for k in GATE_SIZES}, reverse=True):
            part = _trimmed(proposal, k)
            rate = (1.0 + sum(self.suffix.reach(part))) / (t1 + slope * k)
            if rate > best_rate:
                best, best_rate = part, rate
        if best is None:
            self.skips += 1
            return "model", proposal
        self.runs += 1
        return "suffix", best

    def observe(self, proposal: SuffixProposal | None, nodes: int, seconds: float, output: list[int]) -> None:
        """One step: the proposal made for it (whether it ran or not), the nodes of its target
        pass, its seconds, and its output (accepted tokens, then the bonus)."""
        if proposal is not None and proposal.size > 1:
            self.suffix.observe(proposal, output)
        if nodes == 1:
            self.plain_times.append(seconds)
        elif self.plain_times:
            self.slopes.append((seconds - statistics.median(self.plain_times)) / (nodes - 1))

    def stats(self, runs_before: int = 0, skips_before: int = 0) -> dict:
        """Proposals run and skipped since the counts given (a generation's start), and the pass
        model now."""
        t1 = self.pass_seconds(1)
        slope = statistics.median(self.slopes) if self.slopes else None
        return {"gate_runs": self.runs - runs_before, "gate_skips": self.skips - skips_before,
                "gate_plain_step_ms": 1e3 * t1 if t1 is not None else None,
                "gate_ms_per_node": 1e3 * slope if slope is not None else None}


GROW_WINDOW = 8  # steps that grew the next tree ahead, whose gains and costs the overlap gate weighs
GROW_MIN = 4  # of them, with their gains known, before the gate judges
GROW_REST = 8  # steps without growing ahead before the gate tries again
GROW_REST_MAX = 64  # each trial that loses doubles the rest, up to this
GROW_FIRST = 2  # steps without growing ahead that the gate starts with: steps to compare with
GROW_CONTROL = 8  # while growing, after this many steps one that does not: the steps compared with, kept fresh


class OverlapGate:
    """`--overlap auto`: whether a step grows the next tree ahead while its pass waits for
    streamed layers (`SpeculativeDecoder`'s `GrownAhead`), from what growing measured.

    Both sides are measured against steps that did not grow ahead, of as many nodes: the gate
    starts with GROW_FIRST of them, takes them while it rests, and while it grows has a step
    without (a control) after every GROW_CONTROL that grew, so that they stay of the same spell and context.
    - A step that grew pays what its pass (with verification) took beyond the median of the
      recent passes of steps that did not grow (signed, so that a pass's noise cancels over the
      window; not the steps that happened to have no wait while the gate grew: those are the fast
      ones). Until such passes are at hand, the executor's `idle_overrun_seconds` stands in (a
      layer in while a unit of draft work still ran, or on CUDA still queued before it); it is
      not enough on a CPU, where draft work in the waits also slows the loader: on the 2-vCPU
      machine a float32 pass grew by 90 ms a step with overlap where the overrun read 28 ms.
    - It gains, at the next step, what that step's draft (before its pass) took less than the
      median of recent steps that used nothing grown ahead, when it used some (signed: moving a
      grown tree's K/V into place costs too); with no such step of as many nodes (one with suffix
      nodes grafted on, a new width) the grown step counts for nothing. Counting the levels used
      at the draft's average time per level, as a first version did, overstated it: on the
      embedded pair's (4, 4) trees the levels used were worth 10 ms a step by that count, where
      the draft's part took 3.3 ms less than without overlap (2026-12-06).
    The gate keeps growing while the gains of its last GROW_WINDOW grown steps (GROW_MIN at
    least, gains known) are at least their costs, and while their gains add to more than nothing: a
    tree grown ahead that is never used has no upside, and it can cost more than either measure
    sees (on the H200 with random weights, growing that never hit delayed the copies behind the
    buffers it held: + 34.5 ms a step against + 27.5 ms without, 2026-12-04). When it loses it
    stops for GROW_REST steps, then tries again; a trial that loses doubles the rest (up to
    GROW_REST_MAX), one that wins sets it back. Steps whose pass grew nothing (no wait to grow
    into) neither cost nor gain. A tree grown in the last step of an answer is lost with its
    decoder: it gains nothing. One gate lives on the engine per draft and request temperature,
    so what it learned carries from one generation to the next.

    Exactness: the choice is made before the step, from earlier steps; a tree grown ahead is a
    proposal, and whether one was grown changes only what is proposed."""

    def __init__(self):
        self._growing, self.rest_left = False, GROW_FIRST
        self._control = False  # the next step is a control (growing, but this one step not)
        self._since_control = 0
        self.window: deque = deque(maxlen=GROW_WINDOW)  # [cost, gain, gain known] per step that grew
        self.passes: dict[int, deque] = {}  # nodes -> seconds of recent passes of steps that did not grow
        self.drafts: dict[int, deque] = {}  # nodes -> draft seconds of recent steps that used nothing grown
        self.rest = GROW_REST
        self.grown_steps = self.rested_steps = self.stops = 0
        self.cost_seconds = self.gain_seconds = 0.0  # over every step observed
        self._last = None  # the window's entry of the step before, when it grew

    @property
    def grow(self) -> bool:
        """Whether the next step grows ahead."""
        return self._growing and not self._control

    def observe(self, grew: bool, overrun: float, used_levels: int, draft_seconds: float,
                fresh_levels: int, nodes: int = 0, pass_seconds: float = 0.0) -> None:
        """One step: whether its pass grew anything ahead and what the executor found that
        delayed the pass by, the levels of its own tree that came grown ahead, its draft's time
        before the pass and the levels it drew then, and its pass (nodes, seconds)."""
        asked = self.grow  # (what this step was told)
        if fresh_levels > 0 and draft_seconds > 0 and used_levels == 0:  # (every level drawn then)
            self.drafts.setdefault(nodes, deque(maxlen=GROW_WINDOW)).append(draft_seconds)
        if self._last is not None:  # what the step before grew, and this step used
            ref = self.drafts.get(nodes)
            if used_levels and not ref:  # (nothing to compare with: a hybrid step's, a new width's)
                if self._last in self.window:
                    self.window.remove(self._last)
            else:
                gain = statistics.median(ref) - draft_seconds if used_levels else 0.0
                self._last[1], self._last[2] = gain, True
                self.gain_seconds += gain
            self._last = None
        if not asked and nodes > 1 and pass_seconds > 0:  # (told not to grow: any pass, wait or not)
            self.passes.setdefault(nodes, deque(maxlen=GROW_WINDOW)).append(pass_seconds)
        if not self._growing:
            self.rested_steps += 1
            self.rest_left -= 1
            if self.rest_left <= 0:
                self._growing, self._since_control = True, 0
            return
        if self._control:  # (a control step: counted with the rests)
            self._control = False
            self.rested_steps += 1
            return
        if grew:
            self._since_control += 1
            if self._since_control >= GROW_CONTROL:
                self._control, self._since_control = True, 0
            ref = self.passes.get(nodes)
            # (signed: a pass's noise either way cancels over the window, where a floor at the
            # overrun would count every fast pass as the overrun and every slow one in full)
            cost = pass_seconds - statistics.median(ref) if ref else overrun
            self.grown_steps += 1
            self.cost_seconds += cost
            self._last = [cost, 0.0, False]
            self.window.append(self._last)
        known = [e for e in self.window if e[2]]
        if len(known) < GROW_MIN:
            return
        gain, cost = sum(e[1] for e in known), sum(e[0] for e in known)
        if gain > 0 and gain >= cost:
            self.rest = GROW_REST
            return
        self._growing, self._control, self.rest_left = False, False, self.rest
        self.rest = min(2 * self.rest, GROW_REST_MAX)
        self.stops += 1
        self.window.clear()  # (the last step's gain still counts in gain_seconds, at the next step)

    def stats(self, before: tuple = (0, 0, 0, 0.0, 0.0)) -> dict:
        """Counts since `before` (a generation's start: `counts()`), and the state now."""
        now = self.counts()
        grown, rested, stops, cost, gain = (a - b for a, b in zip(now, before))
        return {"gate": "growing" if self._growing else "resting", "grown_steps": grown, "rested_steps": rested,
                "gate_stops": stops, "cost_seconds": cost, "gain_seconds": gain}

    def counts(self) -> tuple:
        return self.grown_steps, self.rested_steps, self.stops, self.cost_seconds, self.gain_seconds


def _pass(timings: Timings, n: int) -> float:
    """The target's pass over n tokens, extrapolated along the last measured slope past the
    widest measured pass (a grafted proposal can widen the tree past it)."""
    xs, ys = timings.target_tokens, timings.target_seconds
    if n <= xs[-1]:
        return timings.target(n)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    return ys[-1] + max(0.0, slope) * (n - xs[-1])


def tree_label(n: int, d: int) -> str:
    return "plain" if n == 1 else f"({n},{d})"


def describe_trees(steps: Counter) -> str:
    """'(48,3) x 30 steps, (16,4) x 12, plain x 3': most used first."""
    parts = [f"{label} x {k}" for label, k in steps.most_common()]
    if parts:
        parts[0] += " steps" if steps.most_common(1)[0][1] != 1 else " step"
    return ", ".join(parts)


@dataclass
class GenerationLog:
    """What one generation did: the trees of its steps, and for each step what the planner
    predicted (seconds, tokens) before it ran and what it measured."""
    start: Choice  # the tree the generation's first step ran, as predicted then
    start_plain_seconds: float  # a plain step, as predicted then
    # the middle 80% of the speed-ups answers of the planned length measure with `start`, from
    # the candidates as they were then (`auto_tree.speedup_spread`; None: plain, or a long answer)
    start_spread: tuple | None = None
    # (the candidates and timings the start was predicted with: `OnlinePlanner.start_for` reads the
    # same prediction for another length; a re-plan replaces the planner's, never these)
    start_model: tuple | None = None
    trees: Counter = field(default_factory=Counter)
    predicted_seconds: float = 0.0
    predicted_tokens: float = 0.0
    measured_seconds: float = 0.0
    measured_tokens: int = 0
    plain_steps: int = 0
    plain_seconds: float = 0.0  # measured, over the plain steps
    plain_times: list = field(default_factory=list)  # each plain step's seconds
    switches: int = 0
    replans: int = 0
    replan_seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"trees": describe_trees(self.trees), "tree_steps": dict(self.trees), "switches": self.switches,
                "replans": self.replans, "replan_seconds": self.replan_seconds,
                "forecast_seconds_per_token": self.predicted_seconds / self.predicted_tokens
                if self.predicted_tokens else None,
                "measured_step_seconds_per_token": self.measured_seconds / self.measured_tokens
                if self.measured_tokens else None,
                # the tokens the steps were forecast to hand out, and did (the prefill's first not counted)
                "forecast_tokens": self.predicted_tokens, "measured_tokens": self.measured_tokens,
                # (the median: one stalled read in a handful of plain steps is not plain decoding's speed)
                "measured_plain_seconds_per_token": statistics.median(self.plain_times) if self.plain_times else None,
                "plain_steps": self.plain_steps}


class OnlinePlanner:
    """One request temperature's online re-planning, kept on the engine from one generation to
    the next (what it learned carries over). `begin()` opens a generation and gives its first
    tree; `record()` takes each step's result and returns the next step's tree when it changes."""

    def __init__(self, vector: AcceptanceVector, base: Timings, candidates: Candidates, adapt: bool = True,
                 start: Choice | None = None):
        """`start`: the first choice (default: the candidates' best under `base` for long
        generations); without adaptation it is kept."""
        self.adapt = adapt
        self.accept = AcceptanceEstimate(vector)
        self.timing = TimingEstimate(base)
        self.candidates = candidates
        self.max_depth = candidates.max_depth
        self.budgets = sorted({n for n, *_ in candidates.items})
        self._table_vector = vector  # the vector the candidates were filled with
        # budgets above this one still hold values of an older vector (a refill covers the
        # budgets up to twice the current one): not compared with the refilled ones (None: none)
        self._fresh_up_to: int | None = None
        self.current = start if start is not None else candidates.best(base)
        self.since_replan = 0
        self.plain_run = 0
        self.probe_wait = PROBE_EVERY
        self.probing = False
        self._probe_choice = self.current
        self.tree_run = 0  # tree steps since the last plain check
        self.checking = 0  # plain steps left in the plain check under way
        self.first_checks = True  # the first PLAIN_CHECK_SAMPLES plain steps, whatever the prediction
        self._seen: set = set()  # tree shapes this planner has run
        self.decode_seconds = 0.0  # measured step time, all generations
        self.replan_seconds = 0.0  # re-planning time, all generations
        self.refill_rate = REFILL_SECONDS_PER_UNIT
        self.suffix = SuffixEstimate()
        self._reach_cache: dict = {}
        self._arm_prediction: tuple[float, float] | None = None  # (seconds, tokens) of a suffix/hybrid step
        self.left: int | None = None  # tokens the generation's steps have yet to make (None: unbounded)
        self.done = 0  # tokens the generation's steps have made
        self.ended: deque = deque(maxlen=LENGTH_WINDOW)  # step tokens of recent answers that ended on their own
        self.generations = 0  # finished with adaptation on (restored ones included)
        self.step_error = 0.0  # the profile's cross-validated step error (the printed range's timing part)
        self.spell = 0.0  # ... and the machine's uncorrected wander from the profile (`SpeedCheck.spell`)
        self.log = GenerationLog(self.current, base.plain())
        self.start_budget = self.current.budget  # the last answer's first tree's (`_refill`)

    @property
    def max_nodes(self) -> int:
        return max(self.budgets or [1])

    def _next(self) -> Choice:
        if self.checking:
            return self.candidates.choice(1, 1, self.timing.timings(), self.planning_length())
        return self._probe_choice if self.probing else self.current

    def spec(self, choice: Choice | None = None) -> TreeSpec:
        c = choice or self._next()
        if c.budget == 1:
            return TreeSpec()
        return TreeSpec("sequoia", c.budget, c.depth, acceptance=self.candidates.acceptance, parents=c.tree.parents)

    def begin(self, length: int | None = None) -> TreeSpec:
        """A new generation whose steps are to make `length` tokens (None: unbounded): its first
        tree, chosen for that length (with adaptation; a probe due at the end of the last
        generation runs first: plain runs count across generations, so a chat of short answers
        probes too)."""
        self.left = None if length is None else max(1, int(length))
        self.done = 0
        timings = self.timing.timings()
        self.log = GenerationLog(self.current, timings.plain())  # (its re-plan counts in this answer's log)
        if self.adapt:
            # (an answer cut off before `finish` counts once; the new one starts from the pair's
            # hazards, the table refilled where they moved)
            self.accept.end_generation()
            self._replan(between=True)  # (between answers it always runs: `_refill`)
        start = self._evaluate(self._next(), timings)
        begun, self.log = self.log, GenerationLog(start, timings.plain())
        self.log.replans, self.log.replan_seconds = begun.replans, begun.replan_seconds
        if start is not None:  # (before a re-plan can refill the candidates the range is read from)
            self.start_budget = start.budget
            from .auto_tree import speedup_spread
            self.log.start_spread = speedup_spread(self.candidates, start, timings.plain(), start.length,
                                                   self.step_error, spell=self.spell)
            self.log.start_model = (self.candidates, timings)
        return self.spec()

    def start_for(self, length: int) -> tuple[Choice, tuple | None] | None:
        """The generation's start, predicted as it was at the start (the same tree, candidates and
        timings) for an answer whose steps make `length` tokens, and the middle of the speed-ups
        such answers measure (`speedup_spread`): what the start's prediction says of an answer that
        ended sooner than planned. A start predicted for 127 step tokens, read against an answer
        that ended by its end-of-sequence token at 66, is 5% fast for the length alone (the demo's
        (16, 16): 0.0434 s/token for 127 tokens, 0.0457 for 66; the demo's answers measured a
        median 8% slower than that start, 2026-12-07). None: plain decoding, or no start."""
        start, model = self.log.start, self.log.start_model
        if model is None or start.budget == 1:
            return None
        cands, timings = model
        length = max(1, int(length))
        choice = cands.choice(start.budget, start.depth, timings, length)
        if choice is None:
            return None
        from .auto_tree import speedup_spread
        return choice, speedup_spread(cands, choice, timings.plain(), length, self.step_error, spell=self.spell)

    def _evaluate(self, choice: Choice, timings: Timings) -> Choice | None:
        return self.candidates.choice(choice.budget, choice.depth, timings, self.planning_length())

    def planning_length(self) -> int | None:
        """The tokens the steps are expected to make still: max_new_tokens' rest, or less where
        earlier answers that ended on their own say so (see the module's docstring)."""
        return expected_length(self.ended, self.done, self.left)

    def finish(self, tokens: int, ended: bool) -> None:
        """A generation's end: its steps made `tokens`; `ended`: by its end-of-sequence token or
        a stop string (not by max_new_tokens), so that its length says how long answers are."""
        if ended and tokens > 0 and self.adapt:
            self.ended.append(int(tokens))
        if self.adapt:
            self.accept.end_generation()  # (this answer's evidence into the pair's hazards)
            self.generations += 1

    def learned_state(self) -> dict:
        """What this planner learned about the pair and the answers, for `planning.learned`:
        the acceptance estimate's anchor and decayed counts, and the recent answer lengths."""
        a = self.accept
        return {"prior_hazards": list(a.prior_h), "accepted": list(a.accepted), "at_risk": list(a.at_risk),
                "ended": list(self.ended), "tree_steps": a.steps, "generations": self.generations}

    def restore(self, state: dict) -> None:
        """Go on from `learned_state()` of an earlier planner of the same pair and stored vector
        (the candidates are expected to be filled with the restored estimate's vector already)."""
        self.accept.restore(state["prior_hazards"], state["accepted"], state["at_risk"], state["tree_steps"])
        self.ended = deque((int(x) for x in state["ended"]), maxlen=LENGTH_WINDOW)
        self.generations = int(state["generations"])

    def _rechoose(self, timings: Timings) -> bool:
        """The best candidate for the tokens left under `timings`, taken when it is predicted
        HYSTERESIS faster than the current choice, or when it is plain decoding predicted faster
        at all (else the current one, evaluated afresh). True when the tree changed."""
        # (only candidates valued under the current vector: a wide tree left with the prior's
        # 17.5 tokens a step beat the refilled (16, 16)'s 8.8 in the demo, and its steps cost
        # twice as much for 19-24 tokens)
        best = self.candidates.best(timings, length=self.planning_length(), max_budget=self._fresh_up_to)
        now = self._evaluate(self.current, timings)
        switched = False
        # (a tree predicted to lose to plain decoding is not kept for the margin's sake: a useless
        # draft's (4, 2) tree, 5.2% slower than plain, stayed on for good; the way back to a tree
        # needs the whole margin, so this does not flap)
        to_plain = best.budget == 1 and now is not None and now.budget > 1
        if (now is None or best.seconds_per_token < now.seconds_per_token * (1 - HYSTERESIS)
                or (to_plain and best.seconds_per_token < now.seconds_per_token)):
            if (best.budget, best.depth) != (self.current.budget, self.current.depth):
                switched = True
                if best.budget > 1:
                    self.plain_run, self.probe_wait = 0, PROBE_EVERY
                    if self.current.budget == 1:  # back on a tree: its own steps before a check
                        self.tree_run = 0
            self.current = best
        else:
            self.current = now
        return switched

    def _in_tail(self) -> bool:
        left = self.planning_length()
        return (left is not None and self.current.budget > 1
                and left < TAIL * (self.current.tree_tokens or self.current.tokens_per_step))

    def _model_reach(self, c: Choice) -> list[float]:
        """The chance that a step of the tree `c` accepts at least j nodes, j = 1 .. its depth - 1:
        the sum of its depth-j nodes' path probabilities (Sequoia's model: a node is reached with
        the product of its ranks' acceptance probabilities, and the nodes of one depth exclude
        each other)."""
        key = (c.budget, c.depth, self._table_vector)
        if key not in self._reach_cache:
            if len(self._reach_cache) > 16:
                self._reach_cache.clear()
            probs, tree = self._table_vector.probs, c.tree
            f = [1.0] * tree.size
            reach = [0.0] * (tree.levels - 1)
            for i in range(1, tree.size):
                r = tree.ranks[i]
                f[i] = f[tree.parents[i]] * (probs[r] if r < len(probs) else 0.0)
                reach[tree.depths[i] - 1] += f[i]
            self._reach_cache[key] = reach
        return self._reach_cache[key]

    def choose_arm(self, proposal: SuffixProposal) -> str:
        """For a step with a suffix proposal: "model" (the planner's tree alone, or plain decoding),
        "suffix" (the proposal alone) or "hybrid" (the proposal grafted onto the tree), whichever
        is predicted fastest per token. A hybrid step reaches depth j unless both the model's tree
        and the proposal stop short of it, taken as independent (an estimate: both follow likely
        text, so it errs towards the hybrid). Each arm's tokens are what one step is expected to
        hand out, E[min(X, tokens left)], so that near the end of an answer no arm is credited
        with tokens past it."""
        if not self.adapt:
            return "hybrid" if self._next().budget > 1 else "suffix"
        timings = self.timing.timings()
        c = self._evaluate(self._next(), timings) or self._next()
        k = proposal.size - 1
        s_reach = self.suffix.reach(proposal)
        gain = sum(s_reach)
        # the draft's catching up on this step's tokens before its next tree: a cost only when a tree
        # is running (on plain decoding the draft is idle and catches up on every token at once
        # when it next drafts, a few more tokens making little difference to that one pass)
        catch_up = timings.draft_factor * timings.draft(1 + round(gain)) if c.budget > 1 else 0.0
        t_pass = _pass(timings, 1 + k)
        t_suffix = max(0.25 * t_pass, t_pass + timings.step_seconds + timings.node_seconds * (1 + k)) + catch_up
        left = self.planning_length()
        cut = None if left is None else max(0, left - 1)  # accepted tokens that can be used

        def handed_out(reach: list[float]) -> float:  # 1 + E[min(accepted, left - 1)]
            return 1.0 + sum(reach[:cut] if cut is not None else reach)
        model_tokens = self.candidates.emitted(c.budget, c.depth, left) or c.tokens_per_step
        options = {"model": (c.seconds_per_step, model_tokens), "suffix": (t_suffix, handed_out(s_reach))}
        if c.budget > 1:
            m_reach = self._model_reach(c)
            depth = max(len(m_reach), len(s_reach))
            m_reach, s_reach = m_reach + [0.0] * (depth - len(m_reach)), s_reach + [0.0] * (depth - len(s_reach))
            tokens = handed_out([1 - (1 - a) * (1 - b) for a, b in zip(m_reach, s_reach)])
            extra = max(0.0, _pass(timings, c.budget + k) - _pass(timings, c.budget)) + timings.node_seconds * k
            # the draft catches up on grafted nodes accepted where its own were not
            extra += catch_up * max(0.0, 1.0 - (m_reach[0] if m_reach else 0.0))
            options["hybrid"] = (c.seconds_per_step + extra, tokens)
        arm = min(options, key=lambda a: options[a][0] / options[a][1])
        self._arm_prediction = options[arm] if arm != "model" else None
        return arm

    def observe_suffix(self, proposal: SuffixProposal, output: list[int]) -> None:
        if self.adapt:
            self.suffix.observe(proposal, output)

    def record(self, spec: TreeSpec, result: VerifyResult, times: StepTimes, first_step: bool,
               arm: str = "model", tokens: int | None = None) -> TreeSpec | None:
        """One step's evidence; the tree for the next step when it differs from `spec`.
        `first_step`: the generation's first (its timing is left out, as is a tree shape's first
        use: allocations, a graph capture). arm: what the step ran (`choose_arm`); a suffix step
        teaches the timing and acceptance models nothing, a hybrid one the acceptance of the
        model's nodes (`result`: the model's view); tokens: what the step emitted (default: the
        result's)."""
        chosen = self._next()
        n = chosen.budget
        predicted = self._evaluate(chosen, self.timing.timings()) or chosen
        log = self.log
        label = tree_label(chosen.budget, chosen.depth)
        log.trees[label if arm == "model" else "suffix" if arm == "suffix" else label + "+suffix"] += 1
        if arm != "model" and self._arm_prediction is not None:
            log.predicted_seconds += self._arm_prediction[0]
            log.predicted_tokens += self._arm_prediction[1]  # (already what it hands out: `choose_arm`)
        else:
            log.predicted_seconds += predicted.seconds_per_step
            log.predicted_tokens += (self.candidates.emitted(predicted.budget, predicted.depth, self.left)
                                     or predicted.tokens_per_step)
        emitted = tokens if tokens is not None else len(result.accepted) + 1
        log.measured_seconds += times.total
        log.measured_tokens += emitted
        self.done += emitted
        if self.left is not None:
            self.left = max(1, self.left - emitted)
        if n == 1 and arm == "model":
            log.plain_steps += 1
            log.plain_seconds += times.total
            log.plain_times.append(times.total)
        self.decode_seconds += times.total
        if not self.adapt:
            return None
        shape = spec.shape()
        if n > 1 and arm != "suffix":
            self._observe_path(shape, result)
        if not first_step and (n == 1 or shape in self._seen) and arm == "model":  # (plain: no allocations)
            self.timing.observe(n, chosen.level_widths, times)
        if arm != "suffix":  # (a suffix step never ran the tree: its first use is still to come)
            self._seen.add(shape)
        self.since_replan += 1
        was_probing, self.probing = self.probing, False
        checked = False
        if self.checking:
            self.checking -= 1
            checked = not self.checking
        elif n > 1 and not was_probing:  # (a probe is not a step of the chosen tree)
            self.tree_run += 1
        if self.current.budget == 1:
            self.plain_run += 1
        if self.since_replan >= EVERY or was_probing or checked or self._in_tail():
            self._replan()
        if was_probing:  # plain still chosen after a probe: wait longer before the next
            self.probe_wait = min(2 * self.probe_wait, PROBE_MAX) if self.current.budget == 1 else PROBE_EVERY
        if self.current.budget == 1 and self.plain_run >= min(self.probe_wait, PROBE_MAX):
            self.plain_run = 0
            probe = self.candidates.best(self.timing.timings(), allow_plain=False, length=self.planning_length(),
                                         max_budget=self._fresh_up_to)
            if probe.budget > 1:
                self.probing, self._probe_choice = True, probe
        # (the first checks run whatever the prediction, unless the caller times plain decoding itself)
        first = self.first_checks and self.timing.plain_samples() < PLAIN_CHECK_SAMPLES
        if (self.current.budget > 1 and not self.probing and not self.checking
                and self.tree_run >= (PLAIN_CHECK_FIRST if first else PLAIN_CHECK_EVERY)):
            self.tree_run = 0
            timings = self.timing.timings()
            now = self._evaluate(self.current, timings)
            if now is not None and (first or now.seconds_per_token * PLAIN_CHECK_BELOW > timings.plain()):
                self.checking = PLAIN_CHECK_STEPS
        nxt = self.spec()
        return None if nxt == spec else nxt

    def _observe_path(self, parents: tuple[int, ...], result: VerifyResult) -> None:
        for children, rank in path_evidence(parents, result.accepted, result.accepted_ranks):
            self.accept.observe(children, rank)
        self.accept.fade()

    def _replan(self, between: bool = False) -> bool:
        """Refill the table if the estimate moved, and re-choose; False when the re-planning
        time allowance (REPLAN_SHARE) is spent and nothing ran (within an answer: `between`
        answers it always runs, `_refill`)."""
        self.since_replan = 0
        allowance = REPLAN_SHARE * self.decode_seconds - self.replan_seconds
        if allowance <= 0 and not between:  # (between answers the fill up to START_FILL runs whatever)
            return False
        t0 = time.perf_counter()
        self._refill(allowance, between)
        self.log.switches += self._rechoose(self.timing.timings())
        spent = time.perf_counter() - t0
        self.log.replans += 1
        self.log.replan_seconds += spent
        self.replan_seconds += spent
        return True

    def _refill(self, allowance: float, between: bool = False) -> None:
        """The DP table filled again with the estimate's vector where it moved by more than
        REFILL_DISTANCE or changed the weighed tree's worth by REFILL_VALUE (`_worth_moved`),
        when its predicted cost fits `allowance`: within an answer up to twice the current budget
        (at least 32); `between` answers (`begin`, `outlook`) up to the widest budget whose fill
        fits, for the next answer starts afresh (the tree an answer ends on, plain decoding in its
        last tokens, says nothing of the one the next should start on), and whatever it costs up
        to START_FILL or the last answer's start budget, if wider (so that a spent share does not
        take the trees an answer started on out of the next one's choice)."""
        vector = self.accept.vector()
        moved = sum(abs(a - b) for a, b in zip(vector.probs, self._table_vector.probs))
        if moved <= REFILL_DISTANCE and not self._worth_moved(vector):
            return
        def units(n: int) -> int:  # (a fill up to budget n: its predicted cost is units * refill_rate)
            return n ** 2 * self.max_depth * vector.width
        if between:  # (the widest fill that fits, or the forced one, which runs whatever it costs)
            forced = max(START_FILL, self.start_budget)
            cap = max((n for n in self.budgets if n <= forced or units(n) * self.refill_rate < allowance),
                      default=0)
        else:
            cap = max(32, 2 * self.current.budget)
        ns = [n for n in self.budgets if n <= cap]
        if ns and (between or units(max(ns)) * self.refill_rate < allowance):
            t_fill = time.perf_counter()
            refilled = Candidates(vector, ns, self.max_depth, TreeTable(vector, max(ns), self.max_depth))
            if self.planning_length() is not None:  # (its step-token distributions too: what a length reads)
                refilled.tokens_for(1)
            self.refill_rate = (time.perf_counter() - t_fill) / units(max(ns))
            # the candidates above the refill keep their trees and values from the last fill
            self.candidates = refilled.merged(self.candidates, above=max(ns))
            self._table_vector = vector
            self._fresh_up_to = max(ns) if max(ns) < max(self.budgets) else None

    def _worth_moved(self, vector: AcceptanceVector) -> bool:
        """Whether the tree re-planning weighs (the current one; on plain decoding the best tree)
        makes REFILL_VALUE more or fewer tokens a step under `vector` than under the table's."""
        c = self.current
        if c.budget == 1:
            c = self.candidates.best(self.timing.timings(), allow_plain=False, length=self.planning_length(),
                                     max_budget=self._fresh_up_to)
            if c.budget == 1:
                return False
        now, then = tree_value(c.tree, vector), tree_value(c.tree, self._table_vector)
        return abs(now - then) > REFILL_VALUE * then

    def outlook(self, length: int | None) -> float:
        """Between answers: plain decoding's time over the best choice's for an answer whose steps
        make `length` tokens, as this planner has learned the pair (the table refilled for the
        pair's estimate where it moved, within the re-planning allowance) and the machine (its
        timing factors): the speed-up the next answer is predicted (1.0: plain decoding wins)."""
        t0 = time.perf_counter()
        self._refill(REPLAN_SHARE * self.decode_seconds - self.replan_seconds, between=True)
        timings = self.timing.timings()
        best = self.candidates.best(timings, length=length, max_budget=self._fresh_up_to)
        self.replan_seconds += time.perf_counter() - t0
        return timings.plain() / best.seconds_per_token

    def predicted_plain(self) -> float:
        return self.timing.timings().plain()
