"""The positional acceptance vector of Sequoia (REFERENCES.md 1.1-1.2)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AcceptanceVector:
    """probs[i] is the probability that the (i+1)-th sampled child of an accepted node is the one
    the target accepts. There is no trailing "all rejected" entry: that probability is
    1 - sum(probs), implied, never stored (the original code mixed both conventions)."""

    probs: tuple[float, ...]

    def __post_init__(self):
        probs = tuple(float(p) for p in self.probs)
        object.__setattr__(self, "probs", probs)
        if not probs:
            raise ValueError("an acceptance vector needs at least one entry")
        bad = [p for p in probs if not (math.isfinite(p) and p >= 0.0)]
        if bad:
            raise ValueError(f"acceptance probabilities must be finite and >= 0, got {bad[0]}")
        if sum(probs) > 1.0 + 1e-9:
            raise ValueError(f"acceptance probabilities sum to {sum(probs):.6f} > 1")

    @property
    def width(self) -> int:
        return len(self.probs)

    @property
    def reject_all(self) -> float:
        return max(0.0, 1.0 - sum(self.probs))

    def to_json(self) -> str:
        return json.dumps({"acceptance": list(self.probs)})

    @staticmethod
    def from_json(text: str) -> "AcceptanceVector":
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("acceptance"), list):
            raise ValueError('expected {"acceptance": [p_1, p_2, ...]}')
        return AcceptanceVector(tuple(data["acceptance"]))


def teacher_forced_rates(target_probs, draft_probs, width: int, generator=None):
    """Analytic acceptance rates [width] at one position (REFERENCES.md 1.2): draw `width` draft
    tokens without replacement from Q, then p_1 = min(1, P(x1)/Q(x1)) and
    p_(j+1) = (1 - p_1 - ... - p_j) * min(1, R_j(x)/Q_j(x)), with R_j the residual and Q_j the
    renormalised draft after j rejections. Averaged over positions, this estimates the vector."""
    import torch

    from .sampling import sample_without_replacement
    P, Q = target_probs.double(), draft_probs.double()
    tokens = sample_without_replacement(Q, width, generator).tolist()
    rates = torch.zeros(width, dtype=torch.float64)
    residual, q, left = P.clone(), Q.clone(), 1.0
    for j, t in enumerate(tokens):
        accept = min(1.0, float(residual[t] / q[t])) if q[t] > 0 else 0.0
        rates[j] = left * accept
        left -= rates[j].item()
        new = (residual - q).clamp_min(0)
        if new.sum() > 0:
            residual = new / new.sum()
        q[t] = 0.0
        if q.sum() <= 0:
            break
        q = q / q.sum()
    return rates


def greedy_rates(target_logits, draft_logits, width: int):
    """At temperature 0: a one-hot [width] at the rank of the target's argmax among the draft's
    top-`width` tokens (all zeros when it is not among them)."""
    import torch
    rates = torch.zeros(width, dtype=torch.float64)
    top = torch.topk(draft_logits, min(width, draft_logits.shape[-1])).indices.tolist()
    best = int(target_logits.argmax())
    if best in top:
        rates[top.index(best)] = 1.0
    return rates
