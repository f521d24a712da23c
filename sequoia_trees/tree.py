"""A speculation tree: nodes in BFS order, siblings contiguous in rank order."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
