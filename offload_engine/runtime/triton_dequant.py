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

import functools
import os

import torch

from ..formats.gguf_native import KINDS  # the same numbering as the C loop's


def available() -> bool:
    """Triton is installed (it ships with torch's CUDA builds) and not turned off."""
    if os.environ.get("SEQUOIA_OFFLOAD_TRITON", "1") == "0":
        return False
    try:
        return _compiled() is not None
    except ImportError:
        return False


@functools.cache
def _compiled():
    from . import triton_kernels  # imports Triton
    return triton_kernels


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
    kernels = _compiled()
    blocks = 32 if per == 32 else 4
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out  # bfloat16 stored as its bits (rounded in the kernel)
    kernels.dequant_kernel[((n + blocks - 1) // blocks,)](data, dst, n, KIND=KINDS[qtype], SIZE=size, PER=per,
                                                          BLOCKS=blocks, BF16=bf16, enable_fp_fusion=False)
    return True
