"""GGUF (llama.cpp) block formats: their sizes, and their dequantization as vectorized torch.

A quantized tensor is a run of fixed-size blocks, each holding its scales and its packed codes
for BLOCK weights (32, or 256 for the K-quants). `dequantize` turns the raw bytes into float32 on
whatever device they are on (the CPU here; the same ops run on a GPU), and equals the `gguf`
package's reference (`gguf.quants.dequantize`) bitwise: the same float32 operations in the same
order (tests/test_gguf_blocks.py). The layouts, as llama.cpp's ggml-common.h defines them:

  Q8_0  d:f16, qs:int8[32]                            w = d * q
  Q4_0  d:f16, qs:u8[16] (low nibbles, then high)     w = d * (q - 8)
  Q4_1  d:f16, m:f16, qs:u8[16]                       w = d * q + m
  Q5_0  d:f16, qh:u32 (bit 4 of each), qs:u8[16]      w = d * (q - 16)
  Q5_1  d:f16, m:f16, qh:u32, qs:u8[16]               w = d * q + m
  Q4_K  d, dmin:f16, 8 packed 6-bit (scale, min), qs:u8[128]   w = d*sc * q - dmin*m, per 32
  Q5_K  as Q4_K, plus qh:u8[32] (bit 4 of each)
  Q6_K  ql:u8[128], qh:u8[64] (2 high bits), scales:int8[16], d:f16    w = d*sc * (q - 32), per 16
"""

from __future__ import annotations

import torch

from . import gguf_native

QK_K = 256
# name: (weights per block, bytes per block)
BLOCK_SIZES = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}
SUPPORTED = tuple(BLOCK_SIZES)


def bits_per_weight(qtype: str) -> float:
    block, size = BLOCK_SIZES[qtype]
    return 8 * size / block


def nbytes(qtype: str, numel: int) -> int:
    """Bytes of `numel` weights in `qtype` (numel a multiple of the block size)."""
    block, size = BLOCK_SIZES[qtype]
    if numel % block:
        raise ValueError(f"{numel} weights are not a whole number of {qtype} blocks of {block}")
    return numel // block * size


def _view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes reinterpreted as `dtype` along the last dimension (copied when their offset or
    layout does not allow a view)."""
    size = dtype.itemsize
    if not b.is_contiguous() or b.storage_offset() % size or any(st % size for st in b.stride()[:-1]):
        b = b.reshape(-1).clone().reshape(b.shape)  # fresh, aligned, row-major
    return b.view(dtype)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32."""
    return _view(b, torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2, k]: low nibbles, then high nibbles."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _high_bits(qh32: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian u32) -> [n, 32] its bits, bit i at i."""
    word = _view(qh32, torch.int32)  # [n, 1]
    return ((word >> torch.arange(32, dtype=torch.int32, device=qh32.device)) & 1).to(torch.uint8)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> the 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequantize_blocks(b: torch.Tensor, qtype: str) -> torch.Tensor:
    """b: uint8 [n_blocks, bytes per block] -> float32 [n_blocks, weights per block]."""
    n = b.shape[0]
    if qtype == "F32":
        return _view(b, torch.float32)
    if qtype == "F16":
        return _view(b, torch.float16).float()
    if qtype == "BF16":
        return (_view(b, torch.int16).to(torch.int32) << 16).view(torch.float32)
    if qtype == "Q8_0":
        return _view(b[:, 2:], torch.int8).float() * _f16(b[:, :2])
    if qtype in ("Q4_0", "Q4_1"):
        off = 2 if qtype == "Q4_0" else 4
        q = _nibbles(b[:, off:]).reshape(n, 32)
        if qtype == "Q4_0":
            return _f16(b[:, :2]) * (q.to(torch.int8) - 8).float()
        return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])
    if qtype in ("Q5_0", "Q5_1"):
        off = 2 if qtype == "Q5_0" else 4
        q = _nibbles(b[:, off + 4:]).reshape(n, 32) | (_high_bits(b[:, off:off + 4]) << 4)
        if qtype == "Q5_0":
            return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()
        return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k_scale_min(b[:, 4:16])
        d = (_f16(b[:, :2]) * sc.float()).reshape(n, 8, 1)
        dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
        qs = b[:, 16:144] if qtype == "Q4_K" else b[:, 48:176]
        q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
        if qtype == "Q5_K":
            qh = b[:, 16:48].reshape(n, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
            q = q | ((qh & 1).reshape(n, 8, 32) << 4)
        return (d * q.float() - dm).reshape(n, QK_K)
    if qtype == "Q6_K":
        ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
        d = (_f16(b[:, 208:210]) * _view(scales, torch.int8).float()).reshape(n, 16, 1)
        low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)  # no host copy
        high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        return (d * q).reshape(n, QK_K)
    raise ValueError(f"GGUF type {qtype} is not supported (supported: {', '.join(SUPPORTED)})")


def _codes(qs: torch.Tensor, qh: torch.Tensor | None = None) -> torch.Tensor:
    """[n, 16] packed nibbles (and [n, 4] high bits) -> uint8 [n, 32] codes, low nibbles first."""
    n = qs.shape[0]
    q = torch.empty(n, 2, 16, dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=q[:, 0])
    torch.bitwise_right_shift(qs, 4, out=q[:, 1])
    q = q.view(n, 32)
    if qh is not None:
        q |= _high_bits(qh) << 4
    return q


def dequantize_into(data: torch.Tensor, qtype: str, out: torch.Tensor, native: bool = True) -> torch.Tensor:
    """`dequantize` written into a float32 tensor `out` (any shape holding the weights in order):
    on the CPU by the compiled loop of gguf_native.c where it is available (native=True), else
    with fewer torch passes over memory for the 32-weight formats; bitwise the same values either
    way (the same float32 multiplications and additions, never fused; tests/test_gguf_blocks.py)."""
    if native and qtype in BLOCK_SIZES and gguf_native.dequantize_into(data, qtype, out, *BLOCK_SIZES[qtype]):
        return out
    size = BLOCK_SIZES[qtype][1]
    b = data.reshape(-1, size)
    n = b.shape[0]
    if out.dtype != torch.float32 or qtype not in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        out.copy_(dequantize_blocks(b, qtype).view(out.shape))
        return out
    o = out.view(n, 32)
    d = _f16(b[:, :2])
    if qtype == "Q8_0":
        torch.mul(_view(b[:, 2:], torch.int8), d, out=o)
        return out
    off = 2 if qtype in ("Q4_0", "Q5_0") else 4
    if qtype in ("Q4_0", "Q4_1"):
        q = _codes(b[:, off:off + 16])
    else:
        q = _codes(b[:, off + 4:off + 20], b[:, off:off + 4])
    if off == 2:  # symmetric: d * (q - 8) or d * (q - 16)
        torch.mul(q.view(torch.int8).sub_(8 if qtype == "Q4_0" else 16), d, out=o)
    else:  # d * q + m
        torch.mul(q, d, out=o)
        o.add_(_f16(b[:, 2:4]))
    return out


def dequantize(data: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes (uint8, flat) of a tensor of `shape` in `qtype` -> float32 [shape], on data's device."""
    if qtype not in BLOCK_SIZES:
        raise ValueError(f"GGUF type {qtype} is not supported (supported: {', '.join(SUPPORTED)})")
    numel = 1
    for s in shape:
        numel *= s
    expected = nbytes(qtype, numel)
    if data.numel() != expected:
        raise ValueError(f"{qtype} tensor of shape {tuple(shape)} needs {expected} bytes, got {data.numel()}")
    size = BLOCK_SIZES[qtype][1]
    return dequantize_blocks(data.reshape(-1, size), qtype).reshape(shape)
