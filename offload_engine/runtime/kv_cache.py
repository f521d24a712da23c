"""Static K/V buffers for every layer of one sequence.

A forward pass writes the K/V of its S new tokens into the slots right after the committed
length (`length .. length+S`) and attends over `0 .. length+S` with an explicit mask. The caller
then decides what to keep, with one explicit call: `advance(S)` keeps all of them (plain
decoding), `commit(slots)` gathers chosen slots (an accepted tree path) into the next contiguous
positions, and `truncate(n)` forgets everything after n tokens.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", batch: int = 1):
        # batch > 1: sequences side by side, all at the same length (distill's batched generation)
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)  # [L, B, KVH, T, D]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    def view(self) -> "KVCache":
        """Another cache over the same K/V buffers with a length of its own: a substitute draft
        writes its tree's K/V after the committed length through it, while the target's own
        length (and the committed K/V before it) stays as the target left it."""
        other = KVCache.__new__(KVCache)
        other.k, other.v, other.length = self.k, self.v, self.length
        return other

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V after the committed length; return K/V over all visible slots.

        k, v: [B, KVH, S, D] -> returns [B, KVH, length+S, D] views.
        """
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} tokens, capacity {self.capacity}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def write_at(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                 visible: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V at `slots` (a device tensor of distinct slot indices, so that a
        captured CUDA graph replays with new values); return K/V over the first `visible` slots
        (a fixed window; the caller's mask hides the slots in it that it must not see).

        k, v: [B, KVH, S, D] -> returns [B, KVH, visible, D] views."""
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer, :, :, :visible], self.v[layer, :, :, :visible]

    def advance(self, tokens: int) -> None:
        """Keep the K/V of the `tokens` slots written by the last forward pass."""
        if self.length + tokens > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length + tokens} tokens, capacity {self.capacity}")
        self.length += tokens

    def commit(self, slots: list[int] | torch.Tensor) -> None:
        """Gather the given scratch slots (absolute indices >= length) into the next contiguous
        slots, all layers at once, and keep them."""
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.k.device)
        n = idx.numel()
        end = self.length + n
        self.k[:, :, :, self.length:end] = self.k.index_select(3, idx)
        self.v[:, :, :, self.length:end] = self.v.index_select(3, idx)
        self.length = end

    def move(self, src: int, dst: int, count: int) -> None:
        """Copy the K/V of slots src..src+count to dst..dst+count, all layers (the ranges may overlap)."""
        if count:
            self.k[:, :, :, dst:dst + count] = self.k[:, :, :, src:src + count].clone()
            self.v[:, :, :, dst:dst + count] = self.v[:, :, :, src:src + count].clone()

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token cache to {length}")
        self.length = length
