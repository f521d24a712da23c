"""Sequoia's optimal tree (REFERENCES.md 1.1), vectorised with numpy.

G(1, l) = 1;  G(n, l) = max over child subtree sizes n_1..n_k (sum n-1, k <= width) of
1 + sum_i p_i G(n_i, l-1). Filled as T[m, l, b] (best m-node, <= l-level tree whose root has
exactly b children, ranks 1..b): T[m, l, b] = max_y T[y, l, b-1] + p_b G(m-y, l-1), a (max, +)
convolution over y computed for all m at once.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .acceptance import AcceptanceVector
from .tree import TreePlan

NEG = -np.inf


def _fill(p: np.ndarray, n: int, d: int):
    """G[m, l] for m in 0..n nodes, l in 0..d levels, and the choices needed to rebuild trees."""
    w = len(p)
    G = np.full((n + 1, d + 1), NEG)
    best_b = np.zeros((n + 1, d + 1), dtype=np.int32)
    split = np.zeros((n + 1, d + 1, w + 1), dtype=np.int32)  # y chosen for T[m, l, b]
    G[1, 1:] = 1.0
    rows = np.arange(n + 1)
    cand = np.empty((n + 1, n + 1))  # cand[m, y]: b-1 children in y nodes, child b in m-y
    for l in range(2, d + 1):
        T = np.full(n + 1, NEG)
        T[1] = 1.0  # b = 0: the root alone
        best = T.copy()
        sub = np.concatenate([np.full(n, NEG), G[:, l - 1]])  # sub[n + k] = G[k, l-1]
        # shifted[m, y] = G[m - y, l-1] = sub[n + m - y]: row m is a reversed window of sub, copied
        # so that every pass below (and the argmax over y) runs along contiguous memory
        shifted = np.ascontiguousarray(sliding_window_view(sub[::-1], n + 1)[::-1])
        # p_b * shifted when p_b = 0: 0 where the subtree exists, -inf where it does not (a plain
        # product would give NaN there; measured vectors often end in zeros)
        zero_term = np.where(np.isneginf(shifted), NEG, 0.0)
        for b in range(1, w + 1):
            if p[b - 1] > 0:
                np.multiply(shifted, p[b - 1], out=cand)
            else:
                np.copyto(cand, zero_term)
            cand += T[None, :]
            y = cand.argmax(axis=1)
            T = cand[rows, y]
            split[:, l, b] = y
            better = T > best
            best = np.where(better, T, best)
            best_b[:, l] = np.where(better, b, best_b[:, l])
        G[:, l] = best
    return G, best_b, split


def expected_tokens_table(acceptance: AcceptanceVector, max_budget: int, max_depth: int) -> np.ndarray:
    """G[n, d] for every budget n <= max_budget and depth d <= max_depth (nodes and levels both
    count the root; entries with n = 0 or d = 0 are -inf)."""
    return _fill(np.asarray(acceptance.probs, dtype=np.float64), max_budget, max_depth)[0]


def optimal_tree(acceptance: AcceptanceVector, budget: int, max_depth: int) -> TreePlan:
    """The tree of exactly `budget` nodes and at most `max_depth` levels with the most expected
    tokens per step."""
    if budget < 1 or max_depth < 1:
        raise ValueError(f"budget and max_depth must be >= 1, got {budget}, {max_depth}")
    if max_depth == 1 and budget > 1:
        raise ValueError("a 1-level tree is the root alone (budget 1)")
    return TreeTable(acceptance, budget, max_depth).tree(budget, max_depth)


class TreeTable:
    """One DP fill up to (max_budget, max_depth), from which the optimal tree of every smaller
    (budget, depth) is read: what the hardware-aware optimizer searches over."""

    def __init__(self, acceptance: AcceptanceVector, max_budget: int, max_depth: int):
        self.p = np.asarray(acceptance.probs, dtype=np.float64)
        self.max_budget, self.max_depth = max_budget, max_depth
        self.G, self._best_b, self._split = _fill(self.p, max_budget, max_depth)

    def value(self, budget: int, depth: int) -> float:
        """G(budget, depth): expected tokens per step of the best tree (-inf when none fits)."""
        if not (1 <= budget <= self.max_budget and 1 <= depth <= self.max_depth):
            raise ValueError(f"({budget}, {depth}) is outside the table ({self.max_budget}, {self.max_depth})")
        return float(self.G[budget, depth])

    def tree(self, budget: int, depth: int) -> TreePlan:
        if not (1 <= budget <= self.max_budget and 1 <= depth <= self.max_depth):
            raise ValueError(f"({budget}, {depth}) is outside the table ({self.max_budget}, {self.max_depth})")
        if not np.isfinite(self.G[budget, depth]):
            raise ValueError(f"no tree of {budget} nodes fits in {depth} levels with at most "
                             f"{len(self.p)} children per node")
        children: dict[int, list[int]] = {}
        spans = [(0, budget, depth)]  # (node id, subtree size, levels) still to expand
        count = 1
        while spans:  # DFS over subtrees; node ids are renumbered BFS below
            node, m, l = spans.pop()
            b = int(self._best_b[m, l]) if m > 1 else 0
            sizes = []
            while b > 0:
                y = int(self._split[m, l, b])
                sizes.append(m - y)
                m, b = y, b - 1
            kids = []
            for size in reversed(sizes):  # rank 1 first
                kids.append(count)
                spans.append((count, size, l - 1))
                count += 1
            children[node] = kids
        return _bfs(children, float(self.G[budget, depth]), self.p)


def _bfs(children: dict[int, list[int]], value: float, p: np.ndarray) -> TreePlan:
    order, parents, depths, ranks, queue = {0: 0}, [-1], [0], [0], [0]
    while queue:
        node = queue.pop(0)
        for rank, kid in enumerate(children.get(node, [])):
            order[kid] = len(parents)
            parents.append(order[node])
            depths.append(depths[order[node]] + 1)
            ranks.append(rank)
            queue.append(kid)
    return TreePlan(tuple(parents), tuple(depths), tuple(ranks), value)


def tree_value(plan: TreePlan, acceptance: AcceptanceVector) -> float:
    """F(T) = sum over nodes of the product of p along the path (root counted as 1)."""
    f = [1.0] * plan.size
    for i in range(1, plan.size):
        rank = plan.ranks[i]
        f[i] = f[plan.parents[i]] * (acceptance.probs[rank] if rank < acceptance.width else 0.0)
    return sum(f)
