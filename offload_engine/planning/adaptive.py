"""Online re-planning for `--tree auto`: the profile and the stored vector are the start, each
step's measurements the truth (SmartSpec's per-step choice from measured goodput, on top of
Sequoia's optimal trees).

After every speculation step the planner records what the step measured:
  * the acceptance evidence: along the accepted path, each node with children either accepted
    its child of rank r (ranks 0..r-1 were tried and rejected) or had all its k children
    rejected. `AcceptanceEstimate` turns these into the hazard of each rank (the chance rank r
    is accepted when ranks below it were not), a Beta posterior per rank whose prior is the
    stored or measured vector counted as PRIOR_NODES observations; older evidence (the prior's
    too) fades by ACCEPT_FORGET per tree step, so a conversation that turns from chat to code is
    followed;
  * the timing evidence: the draft's part of the step and the target's (its pass, the
    verification, the commits), each against what the profile's step model predicts for that
    tree. `TimingEstimate` keeps one factor for each (prior 1, worth PRIOR_STEPS steps, older
    steps fading by TIME_FORGET per step: a disk that slows within seconds is followed); plain
    steps inform the target's factor.
Every EVERY steps the planner re-chooses (budget, depth) among the optimizer's precomputed
candidates (`optimizer.Candidates`) under the updated timings, refilling the DP table only when
the acceptance estimate has moved by more than REFILL_DISTANCE (L1), and never spending more
than REPLAN_SHARE of the decoding time on it. It switches only when the new choice is predicted
HYSTERESIS faster than the current one under the same model (no flapping). When plain decoding
wins, one step in PROBE_EVERY runs the best tree anyway, so that the evidence that would bring
the tree back keeps coming.

Exactness: a step's tree is chosen before that step's target pass, from what earlier steps
verified and measured; verification is exact for any tree, so the output is the target's
(greedy: plain greedy decoding; sampled: the target's distribution).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.dp import TreeTable
from sequoia_trees.optimizer import Candidates, Choice, Timings
from sequoia_trees.verify import VerifyResult

from ..speculation.decoder import StepTimes, TreeSpec

PRIOR_NODES = 8.0  # the prior vector counts as this many observed nodes (at first)
ACCEPT_FORGET = 0.97  # per tree step: evidence 35 steps old weighs a third
PRIOR_STEPS = 3.0  # the profile's timings count as this many steps
TIME_FORGET = 0.85  # per step: the timing factors follow the last few steps
EVERY = 4  # steps between re-plans
HYSTERESIS = 0.05  # a new tree must be predicted this much faster
PROBE_EVERY = 12  # plain steps between probes of the best tree
REFILL_DISTANCE = 0.04  # L1 change of the acceptance estimate that refills the DP table
REPLAN_SHARE = 0.03  # of the decoding time, at most, spent re-planning


class AcceptanceEstimate:
    """The acceptance vector from a prior and observed paths: per rank r, the hazard
    h_r = P(rank r accepted | ranks < r rejected) has a Beta posterior whose prior mean is the
    prior vector's hazard, worth PRIOR_NODES observations at first; the prior fades with the
    evidence (what the run measures wins in the end), down to a permanent anchor of one
    observation; p_r = h_r * prod_{j<r} (1 - h_j)."""

    def __init__(self, prior: AcceptanceVector, strength: float = PRIOR_NODES, forget: float = ACCEPT_FORGET):
        self.width, self.strength, self.forget = prior.width, strength, forget
        left, self.prior_h = 1.0, []
        for p in prior.probs:
            self.prior_h.append(min(1.0, p / left) if left > 1e-12 else 0.0)
            left -= p
        # decayed counts, the prior's pseudo-observations included
        self.accepted = [strength * h for h in self.prior_h]
        self.at_risk = [strength] * self.width
        self.nodes = 0  # observations, undecayed

    def observe(self, children: int, rank: int | None) -> None:
        """A node with `children` children whose child of 0-based `rank` was accepted (None:
        every child rejected)."""
        tried = min(children, self.width) if rank is None else min(rank + 1, self.width)
        for r in range(tried):
            self.at_risk[r] += 1.0
        if rank is not None and rank < self.width:
            self.accepted[rank] += 1.0
        self.nodes += 1

    def fade(self) -> None:
        """Once per step: older evidence weighs less."""
        self.accepted = [a * self.forget for a in self.accepted]
        self.at_risk = [n * self.forget for n in self.at_risk]

    def hazards(self) -> list[float]:
        return [(a + h) / (n + 1.0) for a, n, h in zip(self.accepted, self.at_risk, self.prior_h)]

    def vector(self) -> AcceptanceVector:
        probs, left = [], 1.0
        for h in self.hazards():
            probs.append(left * h)
            left *= 1.0 - h
        return AcceptanceVector(tuple(probs))


class TimingEstimate:
    """Factors on the profile's step model, learned from measured steps: `target` multiplies the
    target's part (its pass over n nodes plus the step's constant and per-node terms; a plain
    step's pass and draw), `draft` the draft's levels. Each is a weighted mean of measured /
    predicted with a prior of 1 worth PRIOR_STEPS steps, older steps fading by TIME_FORGET."""

    def __init__(self, base: Timings, prior_steps: float = PRIOR_STEPS, forget: float = TIME_FORGET):
        self.base, self.forget = base, forget
        self._sums = {"target": [prior_steps, prior_steps], "draft": [prior_steps, prior_steps]}  # [sum, weight]

    def factor(self, part: str) -> float:
        s, w = self._sums[part]
        return s / w

    def _add(self, part: str, ratio: float) -> None:
        if not (math.isfinite(ratio) and ratio > 0):
            return
        ratio = min(max(ratio, 0.1), 10.0)  # one freak step (a page-cache miss, a swap) moves it boundedly
        s = self._sums[part]
        s[0], s[1] = s[0] * self.forget + ratio, s[1] * self.forget + 1.0

    def target_part(self, n: int) -> float:
        """The profile's prediction for the target's part of a step (plain when n == 1)."""
        b = self.base
        if n == 1:
            return b.plain()
        return b.target(n) + b.step_seconds + b.node_seconds * n

    def draft_part(self, widths: tuple[int, ...]) -> float:
        return self.base.draft_factor * sum(self.base.draft(w) for w in widths)

    def observe(self, n: int, widths: tuple[int, ...], times: StepTimes) -> None:
        self._add("target", (times.target + times.rest) / max(self.target_part(n), 1e-9))
        if n > 1:
            self._add("draft", (times.draft - times.catch_up) / max(self.draft_part(widths), 1e-9))

    def timings(self) -> Timings:
        """The profile's timings with the learned factors applied."""
        b, kt, kd = self.base, self.factor("target"), self.factor("draft")
        return replace(b, target_seconds=tuple(t * kt for t in b.target_seconds),
                       draft_seconds=tuple(t * kd for t in b.draft_seconds), step_seconds=b.step_seconds * kt,
                       node_seconds=b.node_seconds * kt, plain_seconds=b.plain_seconds * kt)


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
    trees: Counter = field(default_factory=Counter)
    predicted_seconds: float = 0.0
    predicted_tokens: float = 0.0
    measured_seconds: float = 0.0
    measured_tokens: int = 0
    switches: int = 0
    replans: int = 0
    replan_seconds: float = 0.0
    start: Choice | None = None  # the choice the generation started with, as predicted then
    start_plain_seconds: float = 0.0  # a plain step, as predicted then

    def as_dict(self) -> dict:
        return {"trees": describe_trees(self.trees), "tree_steps": dict(self.trees), "switches": self.switches,
                "replans": self.replans, "replan_seconds": self.replan_seconds,
                "forecast_seconds_per_token": self.predicted_seconds / self.predicted_tokens
                if self.predicted_tokens else None,
                "measured_step_seconds_per_token": self.measured_seconds / self.measured_tokens
                if self.measured_tokens else None}


class OnlinePlanner:
    """One temperature's online re-planning, kept on the engine from one generation to the
    next (what it learned carries over). `begin()` opens a generation and gives its first tree;
    `record()` takes each step's result and returns the next step's tree when it changes."""

    def __init__(self, vector: AcceptanceVector, base: Timings, candidates: Candidates, max_depth: int,
                 adapt: bool = True):
        self.adapt = adapt
        self.accept = AcceptanceEstimate(vector)
        self.timing = TimingEstimate(base)
        self.candidates = candidates
        self.max_depth = max_depth
        self.budgets = sorted({n for n, *_ in candidates.items})
        self._table_vector = vector  # the vector the candidates were filled with
        self.current = candidates.best(base)
        self.since_replan = 0
        self.plain_run = 0
        self.probing = False
        self._probe_choice = self.current
        self._seen: set = set()  # tree shapes this planner has run
        self.log = GenerationLog()

    @property
    def max_nodes(self) -> int:
        return max(self.budgets or [1])

    def spec(self, choice: Choice | None = None) -> TreeSpec:
        c = choice or self.current
        if c.budget == 1:
            return TreeSpec()
        return TreeSpec("sequoia", c.budget, c.depth, acceptance=self.candidates.acceptance, parents=c.tree.parents)

    def begin(self) -> TreeSpec:
        timings = self.timing.timings()
        self.log = GenerationLog(start=self._evaluate(self.current, timings), start_plain_seconds=timings.plain())
        # a probe due at the end of the last generation runs first (plain runs count across
        # generations: a chat of short answers probes too)
        return self.spec(self._probe_choice if self.probing else None)

    def _evaluate(self, choice: Choice, timings: Timings) -> Choice:
        return self.candidates.choice(choice.budget, choice.depth, timings) if choice.budget > 1 else \
            self.candidates.choice(1, 1, timings)

    def record(self, spec: TreeSpec, result: VerifyResult, times: StepTimes, first_step: bool) -> TreeSpec | None:
        """One step's evidence; the tree for the next step when it differs from `spec`.
        `first_step`: the generation's first (its timing is left out, as is a tree shape's first
        use: allocations, a graph capture)."""
        n = len(spec.shape()) if spec.kind != "none" else 1
        chosen = self.current if not self.probing else self._probe_choice
        predicted = self._evaluate(chosen, self.timing.timings())
        self.log.trees[tree_label(chosen.budget, chosen.depth)] += 1
        self.log.predicted_seconds += predicted.seconds_per_step
        self.log.predicted_tokens += predicted.tokens_per_step
        self.log.measured_seconds += times.total
        self.log.measured_tokens += len(result.accepted) + 1
        if not self.adapt:
            return None
        if n > 1:
            self._observe_path(spec.shape(), result)
        shape = spec.shape()
        if not first_step and shape in self._seen:
            self.timing.observe(n, chosen.level_widths, times)
        self._seen.add(shape)
        self.since_replan += 1
        was_probing, self.probing = self.probing, False
        if self.current.budget == 1:
            self.plain_run += 1
        if self.since_replan >= EVERY or was_probing:
            self._replan()
        if self.current.budget == 1 and self.plain_run >= PROBE_EVERY:
            self.plain_run = 0
            probe = self.candidates.best(self.timing.timings(), allow_plain=False)
            if probe.budget > 1:
                self.probing, self._probe_choice = True, probe
                return self.spec(probe)
        nxt = self.spec()
        return None if nxt == spec else nxt

    def _observe_path(self, parents: tuple[int, ...], result: VerifyResult) -> None:
        children = Counter(parents[1:])
        path = [0] + list(result.accepted)
        for i, node in enumerate(path):
            k = children.get(node, 0)
            if k == 0:
                break
            self.accept.observe(k, result.accepted_ranks[i] if i < len(result.accepted) else None)
        self.accept.fade()

    def _replan(self) -> None:
        self.since_replan = 0
        decoding = max(self.log.measured_seconds, 1e-9)
        if self.log.replan_seconds > REPLAN_SHARE * decoding:
            return
        t0 = time.perf_counter()
        vector = self.accept.vector()
        moved = sum(abs(a - b) for a, b in zip(vector.probs, self._table_vector.probs))
        if moved > REFILL_DISTANCE:
            # the refill covers budgets up to twice the current tree (at least 32): growth by
            # doubling per refill keeps each one to milliseconds
            ns = [n for n in self.budgets if n <= max(32, 2 * self.current.budget)]
            if ns:
                self.candidates = Candidates(vector, ns, self.max_depth, TreeTable(vector, max(ns), self.max_depth))
                self._table_vector = vector
        timings = self.timing.timings()
        best = self.candidates.best(timings)
        now = self._evaluate(self.current, timings) if self._has(self.current) else None
        if now is None or best.seconds_per_token < now.seconds_per_token * (1 - HYSTERESIS):
            if (best.budget, best.depth) != (self.current.budget, self.current.depth):
                self.log.switches += 1
                if best.budget > 1:
                    self.plain_run = 0
            self.current = best
        elif now is not None:
            self.current = now
        self.log.replans += 1
        self.log.replan_seconds += time.perf_counter() - t0

    def _has(self, choice: Choice) -> bool:
        return choice.budget == 1 or (choice.budget, choice.depth) in self.candidates._trees

    def predicted_plain(self) -> float:
        return self.timing.timings().plain()
