"""A speculation tree: nodes in BFS order, siblings contiguous in rank order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import AcceptanceVector


@dataclass(frozen=True)
class TreePlan:
    """parents[i] is node i's parent (-1 for the root, node 0); depths count the root as 0;
    ranks[i] is the 0-based sampling rank of node i among its siblings. expected_tokens is the
    tree's value F(T): tokens per target step, bonus included."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]
    expected_tokens: float

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def levels(self) -> int:
        """Number of levels, the root's included (the paper's depth)."""
        return max(self.depths) + 1

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: row i is True at i's ancestors and at i itself."""
        n = self.size
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            if self.parents[i] >= 0:
                mask[i] |= mask[self.parents[i]]
        return mask


def end_probabilities(parents: tuple[int, ...], ranks: tuple[int, ...], acceptance: AcceptanceVector,
                      guesses: int) -> list[list[float]]:
    """Per node and guess g < `guesses`, the probability, by the acceptance vector, that a step
    over this tree ends at the node with its (children + g)-th ranked draft choice as the bonus
    token (the case a next tree can be grown ahead for): the path's acceptance (probs[rank] per
    edge) times probs[children + g]; a rank past the vector's gets half the mass it leaves."""
    p, n = acceptance.probs, len(parents)
    tail = acceptance.reject_all / 2
    kids = [0] * n
    for i in range(1, n):
        kids[parents[i]] += 1
    path = [1.0] * n
    for i in range(1, n):
        path[i] = path[parents[i]] * (p[ranks[i]] if ranks[i] < len(p) else tail)
    return [[path[i] * (p[kids[i] + g] if kids[i] + g < len(p) else tail) for g in range(guesses)]
            for i in range(n)]


def ahead_hit_probability(tree: TreePlan, acceptance: AcceptanceVector, jobs: int, guesses: int) -> float:
    """The probability that a step over `tree` ends as one of the `jobs` most probable
    (end node, bonus guess) cases (`end_probabilities`): the share of steps that can start from
    a tree grown ahead during the pass, when `jobs` cases are grown."""
    cases = sorted((x for row in end_probabilities(tree.parents, tree.ranks, acceptance, guesses) for x in row),
                   reverse=True)
    return min(1.0, sum(cases[:jobs]))
