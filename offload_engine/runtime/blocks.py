"""Weights kept in a storage format (a GGUF block format, or a float narrower than the compute
dtype) and turned into compute-dtype weights where they are used.

The storage format of each layer tensor is decided from its source format, the compute dtype and
the `--weights` choice (`storage_format`):
  * 1-D tensors (norms, biases): the compute dtype, always (they are tiny).
  * `--weights auto`: the source's own format; a float wider than the compute dtype is stored in
    the compute dtype (the cast every use would make anyway).
  * `--weights f32|f16|bf16`: that float (by the same rule), from the source dequantized.
  * `--weights q8_0|q4_0|q4_1`: those blocks, made by the `gguf` package's quantizers from the
    source dequantized to float32; a source already in that format is copied as it is.

`to_dense` is the one conversion every path uses (the layer store's streamed layers, resident
layers kept in blocks, drafts): the float32 dequantization that `gguf.quants.dequantize` defines,
then a cast to the compute dtype, which is exactly what a resident model built from the
dequantized weights holds. It runs as one fused Triton kernel per format on a GPU
(runtime/triton_dequant.py), the compiled loop of formats/gguf_native.c on the CPU, and torch
ops where neither is available; all give the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..formats import gguf_blocks
from . import triton_dequant

FLOAT_FORMATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FORMAT_OF_DTYPE = {v: k for k, v in FLOAT_FORMATS.items()}
WEIGHTS_CHOICES = ("auto", "bf16", "f16", "f32", "q8_0", "q4_0", "q4_1")
QUANTIZERS = ("Q8_0", "Q4_0", "Q4_1")  # the formats --weights can make (the gguf package's quantizers)


def parse_weights(weights: str | None) -> str:
    w = "auto" if weights is None else str(weights).lower()
    if w not in WEIGHTS_CHOICES:
        raise UserError(f"--weights {weights!r}: choose one of {', '.join(WEIGHTS_CHOICES)}")
    return w


def storage_format(source: str, shape: tuple[int, ...], dtype: torch.dtype, weights: str = "auto") -> str:
    """The format a layer tensor is stored (and streamed) in; see the module's docstring."""
    compute = FORMAT_OF_DTYPE[dtype]
    if len(shape) == 1:
        return compute
    fmt = source if weights == "auto" else weights.upper()
    if fmt in FLOAT_FORMATS:
        return fmt if FLOAT_FORMATS[fmt].itemsize < dtype.itemsize else compute
    return fmt


def tensor_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    rows = shape[0] if len(shape) > 1 else 1
    return rows * gguf_blocks.nbytes(fmt, shape[-1])


def check_shape(fmt: str, shape: tuple[int, ...], name: str) -> None:
    block = gguf_blocks.BLOCK_SIZES[fmt][0]
    if shape[-1] % block:
        raise UserError(f"tensor {name}: rows of {shape[-1]} weights are not a whole number of {fmt} blocks "
                        f"of {block}; choose another --weights")


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """float [rows, cols] -> uint8 [rows, bytes per row] in `fmt` (one of QUANTIZERS), the bytes
    the `gguf` package's quantizers make (tests/test_quantized_weights.py compares them): its
    float32 operations, in torch, on w's device, so a 70B store builds in minutes rather than the
    numpy code's hour."""
    rows = w.shape[0]
    if fmt not in QUANTIZERS:
        raise ValueError(f"cannot quantize to {fmt} (only {', '.join(QUANTIZERS)})")
    blocks = w.float().reshape(-1, 32)
    zero = torch.zeros((), device=w.device)

    def div(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
        # tensor by tensor: on CUDA, dividing by a Python number is done as a multiplication by
        # its reciprocal, which can differ from numpy's division in the last bit
        return a / (b if isinstance(b, torch.Tensor) else torch.full_like(a, b))

    if fmt == "Q8_0":  # d = max|x| / 127, q = roundf(x / d) (half away from zero)
        d = div(blocks.abs().amax(dim=1, keepdim=True), 127.0)
        inv = torch.where(d == 0, zero, div(torch.ones_like(d), d))
        x = blocks * inv
        a = x.abs()
        floored = a.floor()
        q = (torch.sign(x) * (floored + (2 * (a - floored)).floor())).to(torch.int8).view(torch.uint8)
        parts = [d.half().view(torch.uint8), q]
    else:
        if fmt == "Q4_0":  # d = (the value of largest magnitude) / -8, q = trunc(x / d + 8.5)
            big = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
            d = div(big, -8.0)
            inv = torch.where(d == 0, zero, div(torch.ones_like(d), d))
            q = (blocks * inv + 8.5).trunc()
            head = [d.half().view(torch.uint8)]
        else:  # Q4_1: d = (max - min) / 15, q = trunc((x - min) / d + 0.5), m = min
            hi, lo = blocks.amax(dim=1, keepdim=True), blocks.amin(dim=1, keepdim=True)
            d = div(hi - lo, 15.0)
            inv = torch.where(d == 0, zero, div(torch.ones_like(d), d))
            q = ((blocks - lo) * inv + 0.5).trunc()
            head = [d.half().view(torch.uint8), lo.half().view(torch.uint8)]
        q = q.to(torch.uint8).clamp_(0, 15)
        parts = head + [q[:, :16] | (q[:, 16:] << 4)]
    return torch.cat(parts, dim=1).reshape(rows, -1)


def to_dense(data: torch.Tensor, fmt: str, shape: tuple[int, ...], dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored bytes (uint8, any shape holding the tensor's bytes in order) -> [shape] in dtype, on
    data's device; written into `out` when given."""
    flat = data.reshape(-1)
    if fmt in FLOAT_FORMATS:
        w = flat.view(FLOAT_FORMATS[fmt]).view(shape)
        return w.to(dtype, copy=True) if out is None else out.copy_(w)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=data.device)
    if data.is_cuda and triton_dequant.dequantize_into(flat, fmt, out):  # one fused kernel
        return out
    if dtype == torch.float32:
        return gguf_blocks.dequantize_into(flat, fmt, out)
    return out.copy_(gguf_blocks.dequantize_into(flat, fmt, torch.empty(shape, device=data.device)))


class PackedWeight:
    """A matrix kept in its storage format; `linear` dequantizes it for each use (a resident
    layer kept in blocks, a draft loaded from a GGUF)."""

    def __init__(self, data: torch.Tensor, fmt: str, shape: tuple[int, ...], dtype: torch.dtype):
        self.data, self.fmt, self.shape, self.dtype = data, fmt, tuple(shape), dtype

    def dense(self) -> torch.Tensor:
        return to_dense(self.data, self.fmt, self.shape, self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dense(), bias)
