"""The hardware-aware optimizer (REFERENCES.md 1.4): choose the tree's size and depth.

For every candidate (budget n, depth d) the optimal tree is read from one DP table; its value
G(n, d) is the expected tokens per step, and one step costs

    t_target(n) + f * (sum over the tree's levels of t_draft(width of that level)) + a + b * n

(the target verifies all n nodes in one pass; the draft runs once per level, the leaves included,
so that an accepted leaf has its K/V; f is the draft's part of a real step over its isolated
level times, a the per-step constant (negative where the loader reads the next pass's first
layers while the draft runs), b the per-node cost of verification and commits; f, a and b are
fitted to real steps by the profiler). Tokens per second = G(n, d) / that.
Plain decoding costs t_target(1) + its own constant.

A generation of L tokens (`length`): its last step's tokens past the end (max_new_tokens, or
the end-of-sequence token) are thrown away, so a deep tree's G overstates what a short answer
gets. With a length, a tree's tokens per step is L / E[N(L)], N(L) the number of steps whose
tokens reach L, each step's tokens X drawn from the tree's own distribution (P(X > j) = the sum
of the path probabilities of its depth-j nodes, Sequoia's model): the renewal function
m(l) = 1 + sum_k P(X = k) m(l - k), computed exactly up to EXACT_LENGTH and continued at slope
1 / E[X] past it (m(l) - l / E[X] converges to (E[X^2] - E[X]) / (2 E[X]^2) within a few
steps). Plain decoding (X = 1) wastes nothing: m(L) = L. Without a length (None), G as is: a
long generation. `Candidates` keeps every (n, d)'s value and
level widths, so that new timings are re-evaluated without filling the DP again (online
re-planning). Timings are
interpolated linearly between measured points (`Timings`); budgets beyond the largest measured
target width are not considered (no extrapolation). Numbers in, numbers out: the caller measures
(profiler) or models (simulator) the timings.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

import numpy as np

from .acceptance import AcceptanceVector
from .dp import TreeTable
from .tree import TreePlan

DEFAULT_BUDGETS = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1024)
DEFAULT_MAX_DEPTH = 24
EXACT_LENGTH = 128  # the renewal function is computed exactly up to this many tokens (see above)


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
    (forward and drawing the children); widths strictly increasing. A speculation step adds
    `step_seconds` (the per-step constant: verification, commits; negative where the next pass's
    first layers load while the draft runs), `node_seconds` per tree node, and pays the draft's
    levels times `draft_factor`. Plain decoding costs target(1) + `plain_seconds`.

    Overlap (drafting while the target streams): `idle_seconds` (per target width, or empty) is
    the part of a pass spent waiting for streamed layers, when the draft may grow the next tree;
    `overlap_use` is the share of the draft work that fits there which the next step gets to use
    (the cases grown that came, at the cost they would have had). A step then costs
    max(target pass, its compute + overlapped draft work) + the draft work that cannot overlap,
    overlapped = overlap_use * min(draft work, idle): see `step`. Where the waits are known, a step
    never costs less than the pass's compute (its time less its waits) and the draft's work."""

    target_tokens: tuple[int, ...]
    target_seconds: tuple[float, ...]
    draft_widths: tuple[int, ...]
    draft_seconds: tuple[float, ...]
    step_seconds: float = 0.0
    node_seconds: float = 0.0
    draft_factor: float = 1.0
    plain_seconds: float = 0.0
    idle_seconds: tuple[float, ...] = ()
    overlap_use: float = 0.0

    def __post_init__(self):
        for name, xs, ys in (("target", self.target_tokens, self.target_seconds),
                             ("draft", self.draft_widths, self.draft_seconds)):
            if not xs or len(xs) != len(ys):
                raise ValueError(f"{name} timings: need as many times as widths, at least one")
            if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] < 1:
                raise ValueError(f"{name} widths must be >= 1 and strictly increasing, got {xs}")
            if any(not (y >= 0) for y in ys):
                raise ValueError(f"{name} times must be >= 0, got {ys}")
        for name in ("step_seconds", "node_seconds", "plain_seconds"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not (math.isfinite(self.draft_factor) and self.draft_factor >= 0):
            raise ValueError(f"draft_factor must be finite and >= 0, got {self.draft_factor}")
        if self.idle_seconds and len(self.idle_seconds) != len(self.target_tokens):
            raise ValueError(f"idle times: need one per target width ({len(self.target_tokens)}) or none, "
                             f"got {len(self.idle_seconds)}")
        if any(not (0 <= y <= t) for y, t in zip(self.idle_seconds, self.target_seconds)):
            raise ValueError(f"idle times must be within 0 and their pass's time, got {self.idle_seconds}")
        if not 0 <= self.overlap_use <= 1:
            raise ValueError(f"overlap_use must be within 0 and 1, got {self.overlap_use}")

    def target(self, n: int) -> float:
        return interpolate(self.target_tokens, self.target_seconds, n)

    def draft(self, w: int) -> float:
        return interpolate(self.draft_widths, self.draft_seconds, min(w, self.draft_widths[-1])) * \
            max(1.0, w / self.draft_widths[-1])  # wider than measured: in slices of the widest

    def plain(self) -> float:
        """One plain decoding step: a one-token pass and a draw (its constant may be negative:
        in a real loop the loader starts the next pass's reads before the host is done; never
        under a quarter of the isolated pass, whatever a noisy constant says)."""
        return max(0.25 * self.target(1), self.target(1) + self.plain_seconds)

    def scaled(self, target: float, draft: float, plain: float | None = None) -> "Timings":
        """These timings with the speculation step's target side (the passes, their waits, the
        per-step and per-node terms) times `target` and the draft's levels times `draft`; a
        plain step then costs `plain` seconds (None: it moves with the target side, its own
        constant scaled too)."""
        plain_seconds = self.plain_seconds * target
        if plain is not None:  # (plain() = target(1) * target + plain_seconds = plain)
            plain_seconds = plain - self.target(1) * target
        return replace(self, target_seconds=tuple(t * target for t in self.target_seconds),
                       idle_seconds=tuple(t * target for t in self.idle_seconds),
                       draft_seconds=tuple(t * draft for t in self.draft_seconds),
                       step_seconds=self.step_seconds * target, node_seconds=self.node_seconds * target,
                       plain_seconds=plain_seconds)

    def idle(self, n: int) -> float:
        """Seconds of a pass over n tokens spent waiting for streamed layers (0 when unknown)."""
        return interpolate(self.target_tokens, self.idle_seconds, n) if self.idle_seconds else 0.0

    def overlapped(self, n: int, draft_work: float) -> float:
        """Of a step's draft work (seconds), the part grown during the pass before it, over n
        tokens as well (a steady run of one tree shape): the share `overlap_use` of what fits
        in the pass's idle time."""
        return self.overlap_use * min(draft_work, self.idle(n))

    def step(self, n: int, widths: tuple[int, ...]) -> tuple[float, float, float]:
        """(seconds, target part, draft part) of a speculation step over a tree of n nodes whose
        levels have these widths; never under a quarter of its isolated target pass (the
        constant may be negative, see `plain`). The draft part is the whole draft work; the
        step pays max(pass, pass - idle + overlapped) + (draft work - overlapped): overlapped
        work fills the pass's waits, at most."""
        t_target = self.target(n)
        t_draft = sum(self.draft(w) for w in widths)
        work = self.draft_factor * t_draft
        over = self.overlapped(n, work)
        total = self.head(n, over) + work - over
        return max(0.25 * t_target, total), t_target, t_draft

    def head(self, n: int, over: float = 0.0) -> float:
        """A tree step's part that is not the draft's work before the pass: the pass over n
        tokens (with `over` seconds of draft work grown in its waits), the step's constant and
        per-node terms. Where the waits are known, never under the pass's compute: what a negative
        constant stands for, the pass's reads done while the draft computes, hides at most the
        waits (a constant of -0.118 s fitted to deep trees made a (4, 4) step 0.110 s, under its
        own 0.139 s pass; it ran 0.205)."""
        t_target, idle = self.target(n), self.idle(n)
        part = max(t_target, t_target - idle + over) + self.step_seconds + self.node_seconds * n
        return max(part, t_target - idle + over) if self.idle_seconds else part


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
    overlap_seconds: float = 0.0  # of the draft's work, grown during the pass before the step
    length: int | None = None  # the generation's tokens it was chosen for (None: a long one)
    tree_tokens: float | None = None  # G(budget, depth) when tokens_per_step is for a length

    @property
    def seconds_per_token(self) -> float:
        return self.seconds_per_step / self.tokens_per_step

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.seconds_per_step

    def describe(self) -> str:
        over = f", {self.overlap_seconds:.3f} s of it during the pass" if self.overlap_seconds else ""
        cut = (f" ({self.tree_tokens:.2f} where no step is cut short by the end)"
               if self.length is not None and self.tree_tokens is not None and self.budget > 1 else "")
        return (f"tree ({self.budget}, {self.depth}): {self.tokens_per_step:.2f} tokens/step predicted{cut}, "
                f"{self.seconds_per_step:.3f} s/step (target {self.target_seconds:.3f} s, draft "
                f"{self.draft_seconds:.3f} s over {len(self.level_widths)} levels{over}, the rest "
                f"{self.seconds_per_step - self.target_seconds - self.draft_seconds + self.overlap_seconds:+.3f} s), "
                f"{self.seconds_per_token:.3f} s/token")


def level_widths(tree: TreePlan) -> tuple[int, ...]:
    counts = [0] * tree.levels
    for d in tree.depths:
        counts[d] += 1
    return tuple(counts)


def step_tokens_distribution(tree: TreePlan, acceptance: AcceptanceVector) -> np.ndarray:
    """P(X = k), k = 0 .. the tree's levels, for X the tokens one step over `tree` makes (the
    accepted nodes and the bonus): P(X > j) is the sum of the path probabilities (the product of
    probs[rank] along the path; 0 past the vector's width) of the tree's depth-j nodes. Its mean
    is the tree's value G."""
    probs = np.asarray(acceptance.probs, dtype=np.float64)
    parents, ranks, depths = (np.asarray(x) for x in (tree.parents, tree.ranks, tree.depths))
    q = np.where(ranks < len(probs), probs[np.minimum(ranks, len(probs) - 1)], 0.0)
    f = np.ones(len(parents))
    levels = int(depths.max()) + 1
    reach = np.ones(levels + 1)  # reach[j] = P(X > j); reach[0] = 1, reach[levels] = 0
    reach[levels] = 0.0
    for j in range(1, levels):  # BFS order: a node's parent is one level up, already done
        at = depths == j
        f[at] = f[parents[at]] * q[at]
        reach[j] = f[at].sum()
    reach = np.minimum.accumulate(np.clip(reach, 0.0, 1.0))
    pmf = np.zeros(levels + 1)
    pmf[1:] = reach[:-1] - reach[1:]
    return pmf


def renewal_table(pmfs: np.ndarray, upto: int = EXACT_LENGTH) -> np.ndarray:
    """[rows, upto + 1]: m(l) for l = 0 .. upto per row of `pmfs` (rows: P(X = k), k = 0 .. K,
    P(X = 0) = 0), the expected number of steps whose tokens reach l, steps independent (the
    renewal function, see the module's docstring)."""
    pmfs = np.atleast_2d(np.asarray(pmfs, dtype=np.float64))
    m = np.zeros((len(pmfs), upto + 1))
    kmax = pmfs.shape[1] - 1
    for l in range(1, upto + 1):
        k = min(kmax, l - 1)  # steps of k < l tokens leave l - k to go; k >= l ends it
        m[:, l] = 1.0 + (pmfs[:, 1:k + 1] * m[:, l - k:l][:, ::-1]).sum(axis=1)
    return m


def steps_from_table(table: np.ndarray, means: np.ndarray, length: int) -> np.ndarray:
    """E[N(length)] per row from its `renewal_table` (continued at slope 1 / mean past its end)."""
    if length < 1:
        return np.zeros(len(table))
    upto = table.shape[1] - 1
    if length <= upto:
        return table[:, length]
    return table[:, upto] + (length - upto) / means


def expected_steps(pmfs: np.ndarray, length: int) -> np.ndarray:
    """E[N(length)] per row of `pmfs` (see `renewal_table`; exact up to EXACT_LENGTH)."""
    pmfs = np.atleast_2d(np.asarray(pmfs, dtype=np.float64))
    means = (pmfs * np.arange(pmfs.shape[1])).sum(axis=1)
    return steps_from_table(renewal_table(pmfs, min(max(length, 0), EXACT_LENGTH)), means, length)


def steps_distribution(pmf: np.ndarray, length: int) -> np.ndarray:
    """P(N(length) = j), j = 0 .. length: the distribution of the number of steps whose tokens
    reach `length`, each step's tokens drawn from `pmf` (P(X = k), P(X = 0) = 0), independent:
    N(l) = 1 when X >= l, else 1 + N(l - X) (the recursion `renewal_table` takes the mean of)."""
    pmf = np.asarray(pmf, dtype=np.float64)
    length = max(1, int(length))
    kmax = len(pmf) - 1
    dist = np.zeros((length + 1, length + 1))  # dist[l, j] = P(N(l) = j)
    dist[0, 0] = 1.0
    for l in range(1, length + 1):
        dist[l, 1] = pmf[l:].sum()  # one step reaches l
        for k in range(1, min(kmax, l - 1) + 1):
            if pmf[k] > 0:
                dist[l, 1:] += pmf[k] * dist[l - k, :-1]
    return dist[length]


def tokens_per_step_for(pmf: np.ndarray, length: int | None) -> float:
    """A step's tokens in a generation of `length` tokens: length / E[N(length)] (None: the mean)."""
    if length is None:
        return float((pmf * np.arange(len(pmf))).sum())
    return length / float(expected_steps(pmf, length)[0])


def evaluate(tree: TreePlan, timings: Timings) -> tuple[float, float, float, tuple[int, ...]]:
    """(seconds per step, target part, draft part, level widths) of one tree."""
    widths = level_widths(tree)
    return (*timings.step(tree.size, widths), widths)


def candidates(timings: Timings, budgets: tuple[int, ...] | None = None) -> list[int]:
    """The budgets searched: the grid (and the measured widths) up to the largest measured one."""
    grid = set(budgets if budgets is not None else DEFAULT_BUDGETS)
    grid |= {n for n in timings.target_tokens if n <= max(grid)}
    return sorted(n for n in grid if 1 <= n <= timings.target_tokens[-1])


class Candidates:
    """Every (budget, depth) of one DP table with its value G and its tree's level widths: the
    optimizer's precomputed table. `best(timings)` re-evaluates them all under new timings
    without filling the DP again or rebuilding a tree (milliseconds: what online re-planning
    calls every few steps). A deeper candidate whose value is no higher than the shallower one's
    at the same budget is left out (the shallower tree is as good and drafts fewer levels)."""

    def __init__(self, acceptance: AcceptanceVector, budgets: list[int], max_depth: int,
                 table: TreeTable | None = None):
        ns = [n for n in budgets if n > 1]
        self.acceptance, self.max_depth = acceptance, max_depth
        self.table = table or (TreeTable(acceptance, max(ns), max_depth) if ns else None)
        self.items: list[tuple[int, int, float, tuple[int, ...]]] = []  # (n, d, G, level widths)
        self._trees: dict[tuple[int, int], TreePlan] = {}
        for n in ns:
            last = -math.inf
            for d in range(2, max_depth + 1):
                value = self.table.value(n, d)
                if not value > last * (1 + 1e-12) + 1e-12:
                    continue
                last = value
                tree = self.table.tree(n, d)
                self._trees[(n, d)] = tree
                self.items.append((n, d, value, level_widths(tree)))
        # per item, P(X = k) (each under the vector its tree was filled with), the renewal table
        # m(0 .. EXACT_LENGTH) and E[X]: made on the first use of a length, then lookups
        self._pmfs: np.ndarray | None = None
        self._renewal: np.ndarray | None = None
        self._means: np.ndarray | None = None
        self._index: dict[tuple[int, int], int] = {}  # (n, d) -> its row (set with the rows)

    def _pmf_rows(self) -> np.ndarray:
        if self._pmfs is None or len(self._pmfs) != len(self.items):
            self._set_rows([step_tokens_distribution(self._trees[(n, d)], self.acceptance)
                            for n, d, *_ in self.items])
        return self._pmfs

    def _set_rows(self, rows: list) -> None:
        width = max((len(r) for r in rows), default=2)
        self._pmfs = np.array([np.pad(r, (0, width - len(r))) for r in rows]).reshape(len(rows), width)
        self._means = (self._pmfs * np.arange(width)).sum(axis=1)
        self._renewal = renewal_table(self._pmfs)
        self._index = {(n, d): i for i, (n, d, *_) in enumerate(self.items)}

    def _tokens_at(self, rows: slice, length: int) -> np.ndarray:
        """length / E[N(length)] for the items of `rows`."""
        self._pmf_rows()
        length = max(1, int(length))
        return length / steps_from_table(self._renewal[rows], self._means[rows], length)

    def tokens_for(self, length: int | None) -> list[float]:
        """Each item's tokens per step in a generation of `length` tokens (None: G)."""
        if length is None:
            return [value for _, _, value, _ in self.items]
        if not self.items:
            return []
        return self._tokens_at(slice(None), length).tolist()

    def _resolve(self, n: int, d: int) -> tuple[int, int] | None:
        """(n, d) as a candidate: a depth left out as no better than a shallower one is that one;
        None when the budget is not a candidate."""
        depths = [k for (m, k) in self._trees if m == n and k <= d]
        return (n, max(depths)) if depths else None

    def step_tokens(self, n: int, d: int) -> np.ndarray | None:
        """P(X = k) of one step of (n, d)'s tree (None: not a candidate; n = 1: one token)."""
        if n == 1:
            return np.array([0.0, 1.0])
        key = self._resolve(n, d)
        return None if key is None else self._pmf_rows()[self._index[key]]

    def emitted(self, n: int, d: int, left: int | None) -> float | None:
        """The tokens one step of (n, d) is expected to hand out when `left` remain to be made:
        E[min(X, left)] (None: E[X], the tree's value; n = 1: one); None when the budget is
        not a candidate."""
        if n == 1:
            return 1.0
        key = self._resolve(n, d)
        if key is None:
            return None
        if left is None:
            return self._trees[key].expected_tokens
        pmf = self._pmf_rows()[self._index[key]]
        reach = pmf[::-1].cumsum()[::-1]  # reach[k] = P(X >= k)
        return float(reach[1:max(1, left) + 1].sum())

    def choice(self, n: int, d: int, timings: Timings, length: int | None = None) -> Choice | None:
        """(n, d) evaluated under `timings` (n = 1: plain decoding) for a generation of `length`
        tokens (None: a long one); a depth left out as no better than a shallower one is that
        one; None when the budget is not a candidate."""
        if n == 1:
            plain = TreePlan((-1,), (0,), (0,), 1.0)
            return Choice(1, 1, 1.0, timings.plain(), timings.target(1), 0.0, (1,), plain, length=length,
                          tree_tokens=1.0)
        key = self._resolve(n, d)
        if key is None:
            return None
        d = key[1]
        tree = self._trees[key]
        tokens = tree.expected_tokens
        if length is not None:
            self._pmf_rows()
            i, length = self._index[key], max(1, int(length))
            tokens = float(self._tokens_at(slice(i, i + 1), length)[0])
        step, t_target, t_draft = timings.step(n, level_widths(tree))
        return Choice(n, d, tokens, step, t_target, t_draft, level_widths(tree), tree,
                      timings.overlapped(n, timings.draft_factor * t_draft), length=length,
                      tree_tokens=tree.expected_tokens)

    def merged(self, other: "Candidates", above: int) -> "Candidates":
        """These candidates, and `other`'s with budgets over `above` (kept as they were: their
        trees, values and step-token distributions all under the vector they were filled with)."""
        kept = [(i, item) for i, item in enumerate(other.items) if item[0] > above]
        if not kept:
            return self
        rows = list(self._pmf_rows()) + [other._pmf_rows()[i] for i, _ in kept]
        for _, (n, d, value, widths) in kept:
            self.items.append((n, d, value, widths))
            self._trees[(n, d)] = other._trees[(n, d)]
        self._set_rows(rows)
        return self

    def best(self, timings: Timings, allow_plain: bool = True, length: int | None = None,
             max_budget: int | None = None) -> Choice:
        """The candidate with the most expected tokens per second (ties: the one found first,
        the smaller tree), among budgets up to the widest measured pass (and `max_budget`), for a
        generation of `length` tokens (None: a long one; see the module's docstring)."""
        limit = timings.target_tokens[-1] if max_budget is None else min(timings.target_tokens[-1], max_budget)
        best_key, best_rate = ((1, 1), 1.0 / timings.plain()) if allow_plain else (None, -1.0)
        for (n, d, _, widths), value in zip(self.items, self.tokens_for(length)):
            if n > limit:
                continue
            rate = value / timings.step(n, widths)[0]
            if rate > best_rate * (1 + 1e-12):
                best_key, best_rate = (n, d), rate
        if best_key is None:
            return replace(self.choice(1, 1, timings, length), seconds_per_step=math.inf)
        return self.choice(*best_key, timings, length)


def choose(acceptance: AcceptanceVector, timings: Timings, budgets: tuple[int, ...] | None = None,
           max_depth: int = DEFAULT_MAX_DEPTH, table: TreeTable | None = None, allow_plain: bool = True,
           length: int | None = None) -> Choice:
    """The (budget, depth) with the most expected tokens per second (ties: the smaller tree).
    Budget 1 (plain decoding, no draft) is a candidate unless `allow_plain` is False: a useless
    draft is not used."""
    ns = candidates(timings, budgets)
    if table is None and max(ns) > 1:
        table = TreeTable(acceptance, max(ns), max_depth)
    return Candidates(acceptance, ns, max_depth, table).best(timings, allow_plain, length)
