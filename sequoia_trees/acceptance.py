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
