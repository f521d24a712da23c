"""The hardware-aware optimizer (REFERENCES.md 1.4): choose the tree's size and depth.

For every candidate (budget n, depth d) the optimal tree is read from one DP table; its value
G(n, d) is the expected tokens per step, and one step costs

    t_target(n) + sum over the tree's levels of t_draft(width of that level) + t_step

(the target verifies all n nodes in one pass; the draft runs once per level, the leaves included,
so that an accepted leaf has its K/V). Tokens per second = G(n, d) / that. Timings are
interpolated linearly between measured points (`Timings`); budgets beyond the largest measured
target width are not considered (no extrapolation). Numbers in, numbers out: the caller measures
(profiler) or models (simulator) the timings.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from .acceptance import AcceptanceVector
from .dp import TreeTable
from .tree import TreePlan

DEFAULT_BUDGETS = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1024)
DEFAULT_MAX_DEPTH = 24


def interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear y(x) through the points; x below the first point takes the first y
    (a pass is never cheaper than the narrowest measured one); above the last is an error."""
    if not xs or len(xs) != len(ys):
        raise ValueError("need as many y values as x values, at least one")
    if x > xs[-1]:
        raise ValueError(f"{x} is beyond the largest measured width {xs[-1]}")
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Timings:
    """Seconds of one target pass over n tokens (after a prefix), of one draft level of w nodes
    (forward and drawing the children), and a fixed correction per speculation step (positive:
    verification and commits; negative: the next pass's first layers loading while the draft
    runs); widths strictly increasing. Plain decoding costs target(1), no correction."""

    target_tokens: tuple[int, ...]
    target_seconds: tuple[float, ...]
    draft_widths: tuple[int, ...]
    draft_seconds: tuple[float, ...]
    step_seconds: float = 0.0

    def __post_init__(self):
        for name, xs, ys in (("target", self.target_tokens, self.target_seconds),
                             ("draft", self.draft_widths, self.draft_seconds)):
            if not xs or len(xs) != len(ys):
                raise ValueError(f"{name} timings: need as many times as widths, at least one")
            if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] < 1:
                raise ValueError(f"{name} widths must be >= 1 and strictly increasing, got {xs}")
            if any(not (y >= 0) for y in ys):
                raise ValueError(f"{name} times must be >= 0, got {ys}")
        if not math.isfinite(self.step_seconds):
            raise ValueError(f"step_seconds must be finite, got {self.step_seconds}")

    def target(self, n: int) -> float:
        return interpolate(self.target_tokens, self.target_seconds, n)

    def draft(self, w: int) -> float:
        return interpolate(self.draft_widths, self.draft_seconds, min(w, self.draft_widths[-1])) * \
            max(1.0, w / self.draft_widths[-1])  # wider than measured: in slices of the widest


@dataclass(frozen=True)
class Choice:
    budget: int
    depth: int
    tokens_per_step: float  # G(budget, depth), the bonus token included
    seconds_per_step: float
    target_seconds: float
    draft_seconds: float
    level_widths: tuple[int, ...]
    tree: TreePlan

    @property
    def seconds_per_token(self) -> float:
        return self.seconds_per_step / self.tokens_per_step

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.seconds_per_step

    def describe(self) -> str:
        return (f"tree ({self.budget}, {self.depth}): {self.tokens_per_step:.2f} tokens/step predicted, "
                f"{self.seconds_per_step:.3f} s/step (target {self.target_seconds:.3f} s + draft "
                f"{self.draft_seconds:.3f} s over {len(self.level_widths)} levels), "
                f"{self.seconds_per_token:.3f} s/token")


def level_widths(tree: TreePlan) -> tuple[int, ...]:
    counts = [0] * tree.levels
    for d in tree.depths:
        counts[d] += 1
    return tuple(counts)


def evaluate(tree: TreePlan, timings: Timings) -> tuple[float, float, float, tuple[int, ...]]:
    """(seconds per step, target part, draft part, level widths) of one tree."""
    widths = level_widths(tree)
    t_target = timings.target(tree.size)
    t_draft = sum(timings.draft(w) for w in widths)
    # never shorter than its own target pass, whatever the correction
    return max(t_target, t_target + t_draft + timings.step_seconds), t_target, t_draft, widths


def candidates(timings: Timings, budgets: tuple[int, ...] | None = None) -> list[int]:
    """The budgets searched: the grid (and the measured widths) up to the largest measured one."""
    grid = set(budgets if budgets is not None else DEFAULT_BUDGETS)
    grid |= {n for n in timings.target_tokens if n <= max(grid)}
    return sorted(n for n in grid if 1 <= n <= timings.target_tokens[-1])


def choose(acceptance: AcceptanceVector, timings: Timings, budgets: tuple[int, ...] | None = None,
           max_depth: int = DEFAULT_MAX_DEPTH, table: TreeTable | None = None, allow_plain: bool = True) -> Choice:
    """The (budget, depth) with the most expected tokens per second (ties: the smaller tree).
    Budget 1 (plain decoding, no draft) is a candidate unless `allow_plain` is False: a useless
    draft is not used."""
    ns = candidates(timings, budgets)
    table = table or TreeTable(acceptance, max(ns), max_depth)
    plain = TreePlan((-1,), (0,), (0,), 1.0)
    best = Choice(1, 1, 1.0, timings.target(1), timings.target(1), 0.0, (1,), plain)
    if not allow_plain:
        best = replace(best, seconds_per_step=math.inf)
    for n in ns:
        if n == 1:
            continue
        for d in range(2, max_depth + 1):
            value = table.value(n, d)
            if value == float("-inf"):
                continue
            tree = table.tree(n, d)
            step, t_target, t_draft, widths = evaluate(tree, timings)
            c = Choice(n, d, value, step, t_target, t_draft, widths, tree)
            if c.tokens_per_second > best.tokens_per_second * (1 + 1e-12):
                best = c
    return best
