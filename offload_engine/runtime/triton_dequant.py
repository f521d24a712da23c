"""Fused GGUF dequantization kernels for the GPU (Triton): one kernel per block format, each
program turning a few blocks into compute-dtype weights in one read and one write.

The layer executor launches them on its copy stream right after a streamed block lands, so they
overlap the previous layer's compute (runtime/streamer.py). Every weight is the value the CPU
dequantization (formats/gguf_blocks.py, bitwise `gguf.quants.dequantize`) gives, cast to the
output dtype: the same float32 multiplications and additions in the same order, launched with
`enable_fp_fusion=False` so that no multiply-add is fused into one rounding. The layouts are
those of formats/gguf_blocks.py; a block's half-precision fields are read byte by byte.

The kernels run on the CPU too under Triton's interpreter (TRITON_INTERPRET=1), which is how the
test suite checks them on a machine without a GPU (tests/test_triton_dequant.py); on a GPU the
`cuda` tests compare them with the CPU path again.
"""

from __future__ import annotations

import os

import torch

KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}

try:  # Triton ships with torch's CUDA builds; without it the torch ops of gguf_blocks run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None and os.environ.get("SEQUOIA_OFFLOAD_TRITON", "1") != "0"


if triton is not None:
    @triton.jit
    def _half(ptr, mask):
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _kernel(src, dst, n_blocks, KIND: tl.constexpr, SIZE: tl.constexpr, PER: tl.constexpr,
                BLOCKS: tl.constexpr, BF16: tl.constexpr):
        blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]  # [BLOCKS, 1]
        i = tl.arange(0, PER)[None, :]  # [1, PER]: the weight within its block
        ok = blk < n_blocks
        mask = ok & (i < PER)
        base = src + blk.to(tl.int64) * SIZE
        if KIND == 0:  # Q8_0: w = q * d
            q = tl.load(base + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w = q * _half(base, ok)
        elif KIND <= 4:  # Q4_0 Q4_1 Q5_0 Q5_1: low nibbles are weights 0..15, high ones 16..31
            OFF: tl.constexpr = 2 if (KIND == 1 or KIND == 3) else 4
            QS: tl.constexpr = OFF + 4 if KIND >= 3 else OFF
            byte = tl.load(base + QS + (i % 16), mask=mask, other=0)
            q = tl.where(i < 16, byte & 15, byte >> 4).to(tl.int32)
            if KIND >= 3:  # the fifth bit of weight i: bit i of a little-endian u32
                qh = tl.load(base + OFF + i // 8, mask=mask, other=0).to(tl.int32)
                q = q | (((qh >> (i % 8)) & 1) << 4)
            d = _half(base, ok)
            if KIND == 1:
                w = d * (q - 8).to(tl.float32)
            elif KIND == 3:
                w = d * (q - 16).to(tl.float32)
            else:
                x = d * q.to(tl.float32)
                w = x + _half(base + 2, ok)
        elif KIND <= 6:  # Q4_K Q5_K: 8 sub-blocks of 32, six-bit scale and minimum each
            j = i // 32
            lane = i % 32
            s_j = tl.load(base + 4 + j, mask=mask, other=0).to(tl.int32)
            s_j4 = tl.load(base + 8 + j, mask=mask, other=0).to(tl.int32)
            s_jm4 = tl.load(base + 4 + tl.maximum(j - 4, 0), mask=mask, other=0).to(tl.int32)
            sc = tl.where(j < 4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 2) & 0x30))
            mn = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 2) & 0x30))
            dd = _half(base, ok) * sc.to(tl.float32)
            dm = _half(base + 2, ok) * mn.to(tl.float32)
            QS: tl.constexpr = 48 if KIND == 6 else 16
            byte = tl.load(base + QS + (j // 2) * 32 + lane, mask=mask, other=0).to(tl.int32)
            q = tl.where(j % 2 == 1, byte >> 4, byte & 15)
            if KIND == 6:
                qh = tl.load(base + 16 + lane, mask=mask, other=0).to(tl.int32)
                q = q | (((qh >> j) & 1) << 4)
            x = dd * q.to(tl.float32)
            w = x - dm
        else:  # Q6_K: 16 sub-blocks of 16, int8 scales; ql low nibbles, qh two high bits
            h = i // 128
            r = i % 128
            low = (tl.load(base + h * 64 + r % 64, mask=mask, other=0).to(tl.int32) >> (4 * (r // 64))) & 15
            high = (tl.load(base + 128 + h * 32 + r % 32, mask=mask, other=0).to(tl.int32) >> (2 * (r // 32))) & 3
            q = (low | (high << 4)) - 32
            scale = tl.load(base + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            ds = _half(base + 208, ok) * scale
            w = ds * q.to(tl.float32)
        if BF16:  # round to nearest even by hand, as torch does (NaN -> 0x7fc0): one rule everywhere
            bits = w.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
            bits = tl.where(w != w, 0x7FC0, bits)
            tl.store(dst + blk.to(tl.int64) * PER + i, bits.to(tl.uint16), mask=mask)
        else:
            tl.store(dst + blk.to(tl.int64) * PER + i, w.to(dst.dtype.element_ty), mask=mask)


def dequantize_into(data: torch.Tensor, qtype: str, out: torch.Tensor) -> bool:
    """Blocks of `qtype` (uint8, contiguous) into `out` (float32, bfloat16 or float16,
    contiguous, on the same device), on the current stream; False where this path does not apply."""
    if qtype not in KINDS or not available() or not data.is_contiguous() or not out.is_contiguous():
        return False
    from ..formats.gguf_blocks import BLOCK_SIZES
    per, size = BLOCK_SIZES[qtype]
    n = data.numel() // size
    if n * size != data.numel() or n * per != out.numel():
        raise ValueError(f"{qtype}: {data.numel()} bytes do not fill {out.numel()} weights")
    blocks = 32 if per == 32 else 4
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out  # bfloat16 stored as its bits (rounded in the kernel)
    _kernel[(triton.cdiv(n, blocks),)](data, dst, n, KIND=KINDS[qtype], SIZE=size, PER=per, BLOCKS=blocks,
                                       BF16=bf16, enable_fp_fusion=False)
    return True
