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

from dataclasses import dataclass, replace
from pathlib import Path

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.dp import TreeTable
from sequoia_trees.optimizer import DEFAULT_BUDGETS, DEFAULT_MAX_DEPTH, Candidates, Choice, Timings, candidates

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

    def for_length(self, length: int | None) -> "AutoPlan":
        """This plan with its choice (and best tree) made for generations of `length` tokens."""
        if length == self.length:
            return self
        choice = self.candidates.best(self.timings, length=length)
        best_tree = choice if choice.budget > 1 else self.candidates.best(self.timings, False, length)
        return replace(self, choice=choice, best_tree=best_tree, length=length)

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
        choice = cands.best(timings, length=length)
        best_tree = choice if choice.budget > 1 else cands.best(timings, False, length)
        plans[t] = AutoPlan(t, vector, Path(path).name, choice, timings.plain(), best_tree, timings, cands, length)
    return plans


def budget_grid(max_budget: int) -> tuple[int, ...]:
    """The optimizer's budget grid with `max_budget` added."""
    return tuple(sorted(set(DEFAULT_BUDGETS) | {max_budget}))
