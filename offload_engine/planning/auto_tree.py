"""`--tree auto`: the tree's size and depth chosen for this machine and this (target, draft) pair.

Inputs, each measured once and cached:
  * the machine's profile (`profiler`): t_target(n), t_draft(w), step overhead;
  * the pair's acceptance vectors: the stored ones (`hw_profiles/acceptance/`) or, when none is
    stored, a quick on-policy measurement at T=0 and T=0.6 (`speculation.measure.vectors_for`,
    `AUTO_PROMPTS` prompts, width 16) written to <cache>/acceptance/ in the `acceptance` command's
    format.
Then the optimizer picks (budget, depth) per temperature; each generation starts from the choice
of the vector nearest its temperature. A choice of budget 1 (the draft does not pay for itself)
decodes plainly. The choice is for generations of `length` tokens when one is given (the last
step of a short answer throws away what its tree accepted past the end: `optimizer`), else for
long ones. With adaptation on (the default), `adaptive.OnlinePlanner` then re-chooses from the
same candidates, for each generation's own max_new_tokens (`OnlinePlanner.begin`) and as the
generation measures its steps; without it the load-time choice is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.dp import TreeTable
from sequoia_trees.optimizer import (DEFAULT_BUDGETS, DEFAULT_MAX_DEPTH, Candidates, Choice, Timings, candidates,
                                     steps_distribution)

from .hw_profile import MeasuredProfile

AUTO_MAX_BUDGET = 1024


@dataclass(frozen=True)
class AutoPlan:
    temperature: float  # of the acceptance vector it was chosen for
    vector: AcceptanceVector
    source: str  # the vector's file name
    choice: Choice
    plain_seconds_per_token: float  # a plain step: plain streamed decoding, predicted
    best_tree: Choice  # the best speculative tree, chosen or not
    timings: Timings  # the profile's step model for this temperature (greedy or sampled)
    candidates: Candidates  # every (budget, depth) of the DP table, for re-planning
    length: int | None = None  # the tokens the steps make (max_new_tokens - 1) `choice` was made for (None: many)
    learned: dict | None = None  # an earlier run's planner state `vector` comes from (`learned`), else None
    step_error: float = 0.0  # the profile's cross-validated error of a step's time (mean |predicted/measured - 1|)
    spell: float = 0.0  # how far the machine has wandered from the profile, uncorrected (a log; `SpeedCheck.spell`)

    def spread(self) -> tuple[float, float] | None:
        """The speed-up that SPREAD_SHARE of answers of `length` tokens measure over plain
        decoding (`speedup_spread`); None for plain decoding or long answers."""
        return speedup_spread(self.candidates, self.choice, self.plain_seconds_per_token, self.length,
                              self.step_error, spell=self.spell)

    def line(self) -> str:
        """'tree (16,16), 0.036 s/token predicted for 67-token answers, 2.67x over plain streamed
        decoding, 8 in 10 answers of 67 tokens: 2.2-3.3x': what the first lines of `demo` and
        `chat` say of the draft's plan."""
        c = self.choice
        tree = "plain" if c.budget == 1 else f"({c.budget},{c.depth})"
        tokens = None if self.length is None else self.length + 1  # (the prefill's token included)
        span = f" for {tokens}-token answers" if tokens is not None else ""
        return (f"tree {tree}, {c.seconds_per_token:.3f} s/token predicted{span}, "
                f"{self.predicted_speedup:.2f}x over plain streamed decoding{spread_text(self.spread(), tokens)}")

    def for_length(self, length: int | None) -> "AutoPlan":
        """This plan with its choice (and best tree) made for generations of `length` tokens."""
        if length == self.length:
            return self
        choice, best_tree = _chosen(self.candidates, self.timings, length)
        return replace(self, choice=choice, best_tree=best_tree, length=length)

    def retimed(self, timings: Timings) -> "AutoPlan":
        """This plan under other timings (`profiler.step_check`'s): its choice and best tree
        chosen again from the same candidates."""
        choice, best_tree = _chosen(self.candidates, timings, self.length)
        return replace(self, timings=timings, choice=choice, best_tree=best_tree,
                       plain_seconds_per_token=timings.plain())

    @property
    def predicted_speedup(self) -> float:
        return self.plain_seconds_per_token / self.choice.seconds_per_token

    def describe(self) -> str:
        span = f" for answers of {self.length + 1} tokens" if self.length is not None else ""
        if self.choice.budget == 1:
            b = self.best_tree
            return (f"tree auto at T={self.temperature:g}{span}: plain decoding, {self.plain_seconds_per_token:.3f} "
                    f"s/token predicted: the draft does not pay on this machine (the best tree, ({b.budget}, "
                    f"{b.depth}), predicts {b.tokens_per_step:.2f} tokens/step at {b.seconds_per_step:.3f} s/step = "
                    f"{b.seconds_per_token:.3f} s/token) [{self.source}]")
        return (f"tree auto at T={self.temperature:g}{span}: {self.choice.describe()}; predicted "
                f"{self.predicted_speedup:.2f}x over plain streamed decoding "
                f"({self.plain_seconds_per_token:.3f} s/token) [{self.source}]")


SPREAD_SHARE = 0.8  # the share of answers the printed range of speed-ups is for
SPREAD_MAX_LENGTH = 1024


def speedup_spread(cands: Candidates, choice: Choice, plain_s: float, length: int | None, error: float = 0.0,
                   share: float = SPREAD_SHARE, spell: float = 0.0) -> tuple[float, float] | None:
    """(low, high): the middle `share` of the speed-ups over plain decoding that answers of
    `length` tokens (the steps' tokens) measure with `choice`'s tree, by the model the choice
    was made with. An answer of L tokens takes N(L) steps, drawn from the tree's own step-token
    distribution (`steps_distribution`), so it measures plain_s * L / (N * seconds_per_step); a
    short answer is a few steps, and its N spreads widely (the demo's 67-token answer: 5 to 8
    steps of one tree). The times are spread too: a speed-up divides two measured times (the
    tree's steps, plain decoding's), each off its prediction by the profile's cross-validated
    error `error` (a mean absolute relative error, sigma = error * sqrt(pi / 2) for a normal
    one), so the ratio is spread log-normally with sigma = error * sqrt(pi) (the two taken as
    independent), and by `spell` more (a log-sigma, added in quadrature): how far the machine's
    speed has wandered from the profile's, which a prediction carries uncorrected
    (`SpeedCheck.spell`; on the 2-vCPU machine the plain steps timed after the demo's answer read
    0.095-0.127 s from one run to the next, where the profile's cross-validated error was 3%). None for plain decoding and long answers (length None, or over
    SPREAD_MAX_LENGTH tokens)."""
    if (choice.budget == 1 or length is None or not math.isfinite(choice.seconds_per_step)
            or length > SPREAD_MAX_LENGTH):  # (a long answer's spread is narrow, and costs L^2 here)
        return None
    pmf = cands.step_tokens(choice.budget, choice.depth)
    if pmf is None:
        return None
    length = max(1, int(length))
    dist = steps_distribution(pmf, length)
    steps = np.nonzero(dist > 1e-12)[0]
    probs = dist[steps] / dist[steps].sum()
    scale = plain_s * length / choice.seconds_per_step  # speed-up = scale / N / f
    sigma = math.hypot(max(0.0, float(error)) * math.sqrt(math.pi), max(0.0, float(spell)))

    def below(x: float) -> float:  # P(speed-up <= x)
        if sigma == 0:
            return float(probs[scale / steps <= x * (1 + 1e-12)].sum())
        z = (np.log(scale / steps) - math.log(x)) / sigma
        return float((probs * 0.5 * (1 + np.vectorize(math.erf)(-z / math.sqrt(2)))).sum())

    def quantile(q: float) -> float:
        lo, hi = scale / steps.max() / math.exp(5 * sigma), scale / steps.min() * math.exp(5 * sigma)
        if sigma == 0:  # (the smallest value whose CDF reaches q)
            values = np.sort(scale / steps)
            return float(next(v for v in values if below(v) >= q - 1e-12))
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if below(mid) < q else (lo, mid)
        return hi

    tail = (1 - share) / 2
    return quantile(tail), quantile(1 - tail)


def spread_text(spread, tokens: int | None = None) -> str:
    """', 8 in 10 answers of 67 tokens: 2.1-3.3x' (`speedup_spread`; `tokens`: the answers'
    length, the prefill's token included), or nothing."""
    if not spread:
        return ""
    span = f"of {tokens} tokens" if tokens else "this long"
    return f", {round(SPREAD_SHARE * 10)} in 10 answers {span}: {spread[0]:.1f}-{spread[1]:.1f}x"


def plan_auto(vectors: dict, profile: MeasuredProfile, max_budget: int = AUTO_MAX_BUDGET,
              max_depth: int = DEFAULT_MAX_DEPTH, length: int | None = None) -> dict[float, AutoPlan]:
    """Per temperature of `vectors`, the optimizer's choice for generations of `length` tokens
    (None: long ones)."""
    budgets = tuple(n for n in budget_grid(max_budget) if n <= max_budget)
    plans = {}
    for t, (vector, path) in vectors.items():
        timings = profile.timings(greedy=t == 0)
        ns = candidates(timings, budgets)
        cands = Candidates(vector, ns, max_depth, TreeTable(vector, max(max(ns), 2), max_depth))
        choice, best_tree = _chosen(cands, timings, length)
        error = profile.fit_cv_error_greedy if t == 0 else profile.fit_cv_error
        plans[t] = AutoPlan(t, vector, Path(path).name, choice, timings.plain(), best_tree, timings, cands, length,
                            step_error=error)
    return plans


def _chosen(cands: Candidates, timings: Timings, length: int | None) -> tuple[Choice, Choice]:
    """(the candidates' best under `timings` for answers of `length` tokens, plain decoding
    included; the best speculative tree, the same one unless plain decoding won)."""
    choice = cands.best(timings, length=length)
    return choice, choice if choice.budget > 1 else cands.best(timings, False, length)


def budget_grid(max_budget: int) -> tuple[int, ...]:
    """The optimizer's budget grid with `max_budget` added."""
    return tuple(sorted(set(DEFAULT_BUDGETS) | {max_budget}))
