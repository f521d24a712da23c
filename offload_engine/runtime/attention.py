"""Which attention kernel a pass uses, chosen once per device, never rebuilt per shape.

Every pass here has an explicit boolean mask (a tree's ancestors, a prefill's causal rows, a
draft level's rows over the whole static cache) and grouped-query heads (Llama 70B: 64 query heads
over 8 K/V heads). Speculation makes a new (query, key) length at every draft level and every step,
so a kernel that plans per shape pays that plan each time. Measured on one H200 (torch 2.11,
2026-11-30): PyTorch's SDPA with a boolean mask and enable_gqa picks cuDNN, which built a new plan
for each new shape (2.8 ms of CPU per call, 520 calls for four steps); with cuDNN's SDPA off it
fell back to its math kernel with a K/V repeat per call. The backends:

  "sdpa"      F.scaled_dot_product_attention(enable_gqa=...), the kernel PyTorch picks. The CPU's
              choice (its math and flash kernels plan nothing), and the reference the others are
              tested against.
  "efficient" K/V expanded to the query heads (a view when there is one K/V head per query head,
              else one copy), then SDPA restricted to the memory-efficient kernel (math as the
              fallback where it is not built): no cuDNN, no per-shape plan, any mask.
  "matmul"    explicit grouped matmuls: each K/V head's queries stacked as one [G*S, D] matrix,
              softmax in fp32 (the scores' matmul in the compute dtype), no K/V copy. Few kernels, for short queries (decode, narrow draft
              levels) where launch count dominates.
  "auto"      "sdpa" on the CPU; "efficient" on a GPU.

The default on a GPU follows the measurement above (cuDNN's per-shape plans were the largest cost
of a step); "matmul" against "efficient" for narrow passes needs a GPU to decide, so it stays
selectable (SEQUOIA_OFFLOAD_ATTENTION=matmul, or `Transformer.attention`), and
benchmarks/gpu_step.py reports both.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "sdpa", "efficient", "matmul")
ENV = "SEQUOIA_OFFLOAD_ATTENTION"


def resolve(backend: str | None, device: torch.device) -> str:
    """The backend a model on `device` uses: the argument, else $SEQUOIA_OFFLOAD_ATTENTION, else auto."""
    backend = backend or os.environ.get(ENV) or "auto"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "auto":
        return "sdpa" if device.type == "cpu" else "efficient"
    return backend


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, KVH, T, D] -> [B, KVH*groups, T, D], each K/V head repeated for its query heads."""
    if groups == 1:
        return x
    B, KVH, T, D = x.shape
    return x[:, :, None].expand(B, KVH, groups, T, D).reshape(B, KVH * groups, T, D)


def _efficient_backends():
    from torch.nn.attention import SDPBackend
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, backend: str) -> torch.Tensor:
    """q [B, H, S, D], keys/values [B, KVH, T, D], mask [B or 1, 1, S, T] bool (True = may attend)
    -> [B, H, S, D]."""
    H, KVH = q.shape[1], keys.shape[1]
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=KVH != H)
    if backend == "efficient":
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(_efficient_backends()):
            return F.scaled_dot_product_attention(q, _expand_kv(keys, H // KVH), _expand_kv(values, H // KVH),
                                                  attn_mask=mask)
    if backend == "matmul":
        B, _, S, D = q.shape
        G, T = H // KVH, keys.shape[2]
        qg = q.reshape(B, KVH, G * S, D)  # head h uses K/V head h // G: group g's rows are contiguous
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))  # [B, KVH, G*S, T]
        scores = scores.view(B, KVH, G, S, T).masked_fill(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(B, KVH, G * S, T)
        return torch.matmul(probs, values).view(B, H, S, D)
    raise ValueError(f"attention backend {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
