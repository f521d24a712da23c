"""Exact verification of a speculation tree (REFERENCES.md 1.3).

Walking down from the root: at each accepted node, its children are tried in sampling order;
child c is accepted with probability min(1, R[c] / Q[c]) where R starts as the target's
distribution P at the node and Q as the distribution the children were drawn from. After each
rejection R becomes the normalised positive part of R - Q, and (children drawn without
replacement) Q loses the rejected token and is renormalised. When every child is rejected, the
bonus token is drawn from R; at a leaf, from P. The emitted tokens then have exactly the target's
distribution. SpecInfer's rule (children drawn with replacement) keeps Q unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


@dataclass(frozen=True)
class VerifyResult:
    accepted: tuple[int, ...]  # accepted node indices along the path (root excluded), in order
    bonus_token: int  # one more token, drawn from the residual (or the target) at the last node
    accepted_ranks: tuple[int, ...]  # the 0-based sibling rank of each accepted node

    @property
    def new_tokens(self) -> int:
        return len(self.accepted) + 1


def _children(parents: list[int] | tuple[int, ...]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    return kids


def _normalise(x: torch.Tensor) -> torch.Tensor | None:
    total = x.sum()
    return x / total if total > 0 else None


def verify_stochastic(parents, tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                      generator: torch.Generator | None = None, without_replacement: bool = True,
                      extra_draws: dict[int, list[int]] | None = None) -> VerifyResult:
    """parents[i]: node i's parent (root = node 0, -1); tokens[i]: node i's token; target_probs and
    draft_probs [n, V]: P and Q at each node (Q is what the node's children were drawn from).
    extra_draws[i]: tokens drawn at node i after its children in the tree, in draw order (a
    best-first tree keeps a prefix of each node's draws whose length depends on the tokens drawn;
    testing the rest the same way keeps the rule exact, and an accepted one is the bonus token).
    Fresh uniforms are drawn from `generator` for every test."""
    kids = _children(parents)
    node, accepted, ranks = 0, [], []
    while True:
        residual = target_probs[node].double()
        q = draft_probs[node].double().clone()
        step = None
        candidates = [(int(tokens[c]), c) for c in kids.get(node, [])]
        candidates += [(t, None) for t in (extra_draws or {}).get(node, [])]
        for rank, (t, child) in enumerate(candidates):
            u = torch.rand((), generator=generator, dtype=torch.float64, device=residual.device)
            if u * q[t] < residual[t]:  # accept with probability min(1, R[t] / Q[t])
                if child is None:  # a drawn token outside the tree: it is the bonus
                    return VerifyResult(tuple(accepted), t, tuple(ranks))
                step = (child, rank)
                break
            new = _normalise((residual - q).clamp_min(0))  # R <- norm(max(R - Q, 0))
            if new is not None:  # no mass left (R == Q): R stands
                residual = new
            if without_replacement:  # the next child was drawn from Q without this token
                q[t] = 0.0
                q = _normalise(q)
                if q is None:
                    break
        if step is None:
            return VerifyResult(tuple(accepted), sample(residual.float(), generator), tuple(ranks))
        node = step[0]
        accepted.append(step[0])
        ranks.append(step[1])


def verify_greedy(parents, tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Accept a child iff its token is the target's argmax at the parent; the bonus is the argmax
    at the last accepted node."""
    kids = _children(parents)
    node, accepted, ranks = 0, [], []
    while True:
        best = int(target_logits[node].argmax())
        match = [(r, c) for r, c in enumerate(kids.get(node, [])) if int(tokens[c]) == best]
        if not match:
            return VerifyResult(tuple(accepted), best, tuple(ranks))
        rank, node = match[0]
        accepted.append(node)
        ranks.append(rank)
