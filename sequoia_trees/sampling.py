"""Turning logits into a distribution (temperature, top-k, top-p) and drawing from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (nucleus) truncation.

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits.float()
    # shift by the max first: a tiny temperature then gives -inf (not NaN) away from the argmax
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id drawn from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def gumbel_top_k(probs: torch.Tensor, k: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from every row of probs [..., V] at once, on probs' device
    (Gumbel top-k: the k largest log(p) + Gumbel noise are distributed as k successive draws, each
    from the renormalised remainder). Returns (ids [..., k], keys [..., k]) in sampling order; a key
    is -inf where the row's support ran out (that id was not drawn)."""
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    keys = torch.log(probs.double()) + gumbel  # -inf where p == 0
    top = torch.topk(keys, min(k, probs.shape[-1]))
    return top.indices, top.values


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to k distinct token ids drawn from probs [V] without replacement, in sampling order
    (`gumbel_top_k`). Tokens of probability 0 are never drawn, so fewer than k ids come back when
    the support is smaller than k."""
    ids, keys = gumbel_top_k(probs, k, generator)
    return ids[torch.isfinite(keys)]


def sample_with_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k independent draws from probs [V] (SpecInfer's children; duplicates possible)."""
    return torch.multinomial(probs, k, replacement=True, generator=generator)


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from every row of probs [..., V], on probs' device, with no host synchronization
    (unlike torch.multinomial): the exponential race, argmax p_i / E_i with E_i ~ Exp(1) i.i.d.,
    picks i with probability p_i / sum(p). E is kept away from 0 so that a zero-probability token
    can never win (0 / 0)."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator).clamp_min_(1e-30)
    return (probs.float() / race).argmax(-1)
