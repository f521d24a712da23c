"""SpecExec-style best-first tree growth: expand the most probable frontier candidates first.

A candidate is a drafted child of a node already in the tree, scored by its cumulative draft
log-probability (the parent's plus its own). Siblings are kept as a prefix of the order they
were drawn in (what exact verification needs), so a sibling's score is capped by the score of
the one drawn before it. Candidates pop globally best first; a depth cap stops growth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    parent: int  # node index in the tree
    token: int
    rank: int  # 0-based position in the parent's draw order
    score: float  # cumulative log-probability (capped by the previous sibling's)
    depth: int  # depth the node would have (root 0)


class BestFirstFrontier:
    def __init__(self, max_depth: int):
        """max_depth counts levels, the root's included: nodes deeper than max_depth - 1 are never offered."""
        self.max_depth = max_depth
        self._heap: list[tuple[float, int, int, Candidate]] = []
        self._count = 0

    def offer(self, parent: int, parent_score: float, parent_depth: int, tokens: list[int],
              logprobs: list[float]) -> None:
        """A node's drafted children, in the order they were drawn."""
        if parent_depth + 1 > self.max_depth - 1:
            return
        cap = float("inf")
        for rank, (tok, lp) in enumerate(zip(tokens, logprobs)):
            cap = min(cap, parent_score + lp)
            cand = Candidate(parent, tok, rank, cap, parent_depth + 1)
            self._count += 1
            heapq.heappush(self._heap, (-cap, rank, self._count, cand))  # ties: earlier rank first

    def pop(self, n: int) -> list[Candidate]:
        """Up to n best candidates, never a sibling before the one drawn ahead of it."""
        out: list[Candidate] = []
        while self._heap and len(out) < n:
            out.append(heapq.heappop(self._heap)[3])
        return out

    def __len__(self) -> int:
        return len(self._heap)
