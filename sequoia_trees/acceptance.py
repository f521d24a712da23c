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


def tried_ranks(children: int, rank: int | None, width: int) -> int:
    """How many of a node's first ranks (of `width` counted) were tried: those up to the accepted
    `rank`, or all of its `children` when every one was rejected (None)."""
    return min(children, width) if rank is None else min(rank + 1, width)


def vector_from_hazards(hazards) -> AcceptanceVector:
    """p_r = h_r * prod_{j<r} (1 - h_j): the vector of per-rank hazards (the chance rank r is
    accepted when the ranks below it were not)."""
    probs, left = [], 1.0
    for h in hazards:
        probs.append(left * h)
        left *= 1.0 - h
    return AcceptanceVector(tuple(probs))


def path_evidence(parents, accepted, ranks) -> list[tuple[int, int | None]]:
    """What one verified step says of the acceptance hazards: along its accepted path (the root,
    then `accepted`, node indices into the tree of `parents`), (children, rank) for each node
    with children, `rank` the 0-based rank of the child accepted there (`ranks`, one per accepted
    node) or None where every child was rejected. Ranks below the accepted one were tried and
    rejected; a node whose children were all rejected tried them all."""
    counts: dict[int, int] = {}
    for p in parents[1:]:
        counts[p] = counts.get(p, 0) + 1
    out = []
    for i, node in enumerate([0, *accepted]):
        k = counts.get(node, 0)
        if k == 0:
            break
        out.append((k, ranks[i] if i < len(accepted) else None))
    return out


class RankEvidence:
    """Counts per rank r of nodes where r was tried (ranks below it rejected) and where it was
    the one accepted: the hazards h_r = accepted_r / at_risk_r, the vector p_r = h_r * prod_{j<r}
    (1 - h_j) (Sequoia's positional vector, the same at every depth). From a one-level tree of
    `width` children this is exactly the frequency of each accepted rank; from deeper trees every
    node of the accepted path counts, so a deep tree's step measures the first ranks several times
    over where a one-level tree's measures them once."""

    def __init__(self, width: int):
        self.width = width
        self.at_risk = [0] * width
        self.accepted = [0] * width

    def observe(self, children: int, rank: int | None) -> None:
        for r in range(tried_ranks(children, rank, self.width)):
            self.at_risk[r] += 1
        if rank is not None and rank < self.width:
            self.accepted[rank] += 1

    def observe_step(self, parents, accepted, ranks) -> None:
        for children, rank in path_evidence(parents, accepted, ranks):
            self.observe(children, rank)

    def add_counts(self, at_risk, accepted) -> None:
        """Another's counts (`as_dict`'s lists), rank by rank."""
        for r, (n, a) in enumerate(zip(at_risk, accepted)):
            if r < self.width:
                self.at_risk[r] += n
                self.accepted[r] += a

    def vector(self) -> AcceptanceVector:
        """The vector these counts make (a rank never tried: hazard 0)."""
        return vector_from_hazards(a / n if n else 0.0 for a, n in zip(self.accepted, self.at_risk))

    def as_dict(self) -> dict:
        return {"at_risk": list(self.at_risk), "accepted": list(self.accepted)}


# ---- how much the acceptance moves from one prompt to the next ------------------------------

PROMPT_MIN_TRIES = 8  # a prompt's rank-1 tries for its count to enter `prompt_tau`
PROMPT_MIN_PROMPTS = 4  # prompts with that many, for an estimate
TAU_GRID = tuple(i * 0.05 for i in range(61))  # 0 .. 3, the values of tau tried
_NODES = 16  # Gauss-Hermite nodes of the normal integral


def prompt_tau(counts) -> tuple[float, float] | None:
    """How much the first rank's acceptance moves from one prompt to the next beyond chance, from
    per-prompt (tried, accepted) rank-1 counts: a prompt's log-odds of accepting rank 1 drawn from
    a normal of mean mu and standard deviation tau, its count binomial given them; (tau at the
    maximum of the likelihood, mu profiled out; the upper end of its 90% interval, where twice
    the log-likelihood has fallen by 2.71). Both over TAU_GRID. None with fewer than
    PROMPT_MIN_PROMPTS counts of PROMPT_MIN_TRIES tries or more (`benchmarks/prompt_spread.py`)."""
    import numpy as np
    used = [(float(n), float(a)) for n, a in counts if n >= PROMPT_MIN_TRIES and 0 <= a <= n]
    if len(used) < PROMPT_MIN_PROMPTS:
        return None
    n, a = (np.array(x) for x in zip(*used))
    z, w = np.polynomial.hermite_e.hermegauss(_NODES)
    w = w / w.sum()
    pooled = (a.sum() + 0.5) / (n.sum() + 1.0)
    mus = math.log(pooled / (1 - pooled)) + np.linspace(-4.0, 4.0, 81)
    tau = np.array(TAU_GRID)
    x = mus[:, None, None] + tau[None, :, None] * z[None, None, :]  # [mu, tau, node]
    log_h, log_1h = -np.logaddexp(0.0, -x), -np.logaddexp(0.0, x)
    per = a[:, None, None, None] * log_h + (n - a)[:, None, None, None] * log_1h  # [prompt, mu, tau, node]
    top = per.max(axis=-1, keepdims=True)
    ll = (np.log((np.exp(per - top) * w).sum(axis=-1)) + top[..., 0]).sum(axis=0)  # [mu, tau]
    profile = ll.max(axis=0)
    best = int(profile.argmax())
    inside = np.nonzero(2 * (profile[best] - profile) <= 2.71)[0]
    return float(tau[best]), float(tau[inside.max()])
