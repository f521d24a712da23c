"""Weight-only quantisation for the self-draft (`--draft self-int8` / `self-int4`).

The self-draft is a low-bit copy of the target's decoder layers kept resident; it shares the
target's embeddings, final norm and head (resident anyway) and keeps its own copy of the small
per-layer norms. Only its speed depends on the quantisation: verification makes the output the
target's whatever the draft proposes.

Schemes, and the error bound each guarantees per weight (tested):
  * int8: symmetric, one scale per output channel: s = max|w_row| / 127, q = round(w / s) in
    [-127, 127]. |w - q s| <= s / 2 = max|w_row| / 254.
  * int4: asymmetric, one (scale, minimum) pair per group of `group_size` inputs of a row:
    s = (max - min) / 15, q = round((w - min) / s) in [0, 15], stored two per byte.
    |w - (q s + min)| <= s / 2 = (max - min) / 30 of the group.

Matmul backends:
  * "kernel" (default): torch's packed integer matmul kernels, `_weight_int8pack_mm` and
    `_weight_int4pack_mm` (CUDA) / `_weight_int4pack_mm_for_cpu`, fed bfloat16 activations
    (the output is cast back to the compute dtype). Each weight is checked against the
    dequantised reference when it is built; a kernel that is missing or disagrees falls back to
    "dequant". bfloat16 because the CPU kernels are fast only there: measured on this project's
    2-vCPU machine, a 1536x576 matrix times 64 rows took 0.9 ms (int8) and 0.8 ms (int4) with
    bfloat16 activations but 45 ms and 51 ms with float32 ones (dense float32: 0.8 ms).
    On the CPU, an int8 matmul over WIDE_ROWS rows or more (a draft level of a wide tree) takes
    the integer GEMM `torch._int_mm` instead, its activations quantised per row as the weights
    are (symmetric, s_x = max|x_row| / 127, so |x - q_x s_x| <= max|x_row| / 254): the packed
    kernel's time grows with the rows, the GEMM's hardly. Measured on the 2-vCPU machine, a
    1536x576 matrix took 168 / 302 us for 12 / 24 rows in the packed kernel and 75 / 99 us in the
    GEMM (30 / 55 us for one row: fewer rows stay on the packed kernel). That GEMM is fast only
    where the CPU has VNNI (AVX-512 or AVX-VNNI): on an AVX2-only host of the same machine kind
    (2026-12-03) the same matrix took 15.7 ms for 32 rows in the GEMM and 1.0 ms in the packed
    kernel, and a 64-node draft level of self-q8 took 4 s instead of 0.3. So the GEMM is taken
    only where it is timed faster than the packed kernel on WIDE_PROBE_ROWS rows (`_wide_pays`:
    once per matrix shape and process, best of three each).
  * "dequant": dequantise the matrix into the compute dtype, then one dense matmul (2.5-5 ms
    for that matrix on the CPU: the fallback).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCHEMES = ("int8", "int4")
BACKENDS = ("auto", "kernel", "dequant")
DEFAULT_GROUP_SIZE = 64  # divides every Llama-family width (576, 1536, 4096, 8192, 11008, 14336, 28672)
_INNER_K_TILES = 2
KERNEL_DTYPE = torch.bfloat16  # activations and scales of the packed kernels
WIDE_ROWS = 8  # CPU int8: from this many rows on, the integer GEMM with activations quantised per row
WIDE_PROBE_ROWS = 32  # ... where it beats the packed kernel on this many rows (`_wide_pays`)
_WIDE_PAYS: dict[tuple[int, int], bool] = {}  # (out_features, in_features) -> timed once per process


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q int8 [N, K], scale fp32 [N])."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q uint8 [N, K] with values 0..15, scale fp32 [N, K/g], minimum fp32 [N, K/g])."""
    N, K = w.shape
    g = w.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), scale, lo


def error_bound(w: torch.Tensor, scheme: str, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """The documented per-weight bound on |w - dequantised w| (before the compute-dtype cast)."""
    w = w.float()
    if scheme == "int8":
        return (w.abs().amax(dim=1, keepdim=True) / 254).expand_as(w)
    N, K = w.shape
    g = w.reshape(N, K // group_size, group_size)
    return ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 30).expand_as(g).reshape(N, K)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], -1)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and per-row scales [N] -> the float32 matrix."""
    return q.to(torch.float32) * scale.float()[:, None]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Nibble-packed codes [N, K/2] and each group's scale and minimum [N, K/g] -> the float32 matrix."""
    N, groups = scale.shape
    q = unpack_nibbles(packed).to(torch.float32).reshape(N, groups, -1)
    return (q * scale.float()[..., None] + minimum.float()[..., None]).reshape(N, -1)


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A fast matmul's probe output against the dequantised reference's: within 2e-2 of the
    output's scale (bfloat16 activations and scales, or int8 ones, round to a few parts in a
    thousand)."""
    return bool((got - want).abs().max() <= 2e-2 * float(want.abs().max().clamp_min(1e-6)))


@dataclass
class QuantizedLinear:
    """A weight matrix [out_features, in_features] in int8 or int4, with its matmul."""
    scheme: str
    out_features: int
    in_features: int
    group_size: int
    dtype: torch.dtype  # compute dtype of activations and of the dequantised matrix
    backend: str  # "kernel" or "dequant" (resolved)
    data: torch.Tensor  # int8 [N, K]; int4: nibbles uint8 [N, K/2], or the kernel's packed layout
    scale: torch.Tensor  # int8: [N]; int4: [N, K/g]
    minimum: torch.Tensor | None = None  # int4: [N, K/g]
    scale_zeros: torch.Tensor | None = None  # int4 kernel: [K/g, N, 2] (scale, zero = min + 8 scale)
    wide: bool = False  # CPU int8 kernel: WIDE_ROWS rows or more take the integer GEMM

    @classmethod
    def from_weight(cls, w: torch.Tensor, scheme: str, group_size: int = DEFAULT_GROUP_SIZE,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    backend: str = "auto") -> "QuantizedLinear":
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantisation scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        device = torch.device(device)
        N, K = w.shape
        if scheme == "int4" and K % group_size:
            raise ValueError(f"int4 group size {group_size} does not divide the {K} inputs of a {N}x{K} matrix")
        want = "kernel" if backend == "auto" else backend
        if scheme == "int8":
            q, scale = quantize_int8(w)
            ql = cls(scheme, N, K, 0, dtype, "dequant", q.to(device), scale.to(device))
        else:
            q, scale, lo = quantize_int4(w, group_size)
            ql = cls(scheme, N, K, group_size, dtype, "dequant", pack_nibbles(q).to(device), scale.to(device),
                     lo.to(device))
        if want == "kernel":
            ql._try_kernel(q)
        return ql

    # ---- backends --------------------------------------------------------------------------------

    def _try_kernel(self, q: torch.Tensor) -> None:
        """Switch to the packed kernel if it exists here and matches the dequantised reference."""
        reference = self.dequantize()
        probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(
            self.data.device, self.dtype)
        reference = reference.to(KERNEL_DTYPE).to(self.dtype)
        saved = (self.data, self.scale, self.scale_zeros)
        try:
            if self.scheme == "int8":
                self.scale = self.scale.to(KERNEL_DTYPE)
            else:
                self.scale_zeros = self._scale_zeros()
                self.data = self._pack_int4_kernel(q.to(self.data.device))
            self.backend = "kernel"
            got = self.linear(probe).float()
            want = F.linear(probe, reference).float()
            if not _agrees(got, want):
                raise RuntimeError("packed kernel disagrees with the dequantised matmul")
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            self.data, self.scale, self.scale_zeros = saved
            self.backend = "dequant"
            return
        if self.scheme == "int8" and self.data.device.type == "cpu":
            self._try_wide(reference)
        if self.scheme == "int4":  # the kernel's layout replaces the nibbles, scales and minima
            self.scale, self.minimum = self.scale_zeros, None

    def _try_wide(self, reference: torch.Tensor) -> None:
        """Use the integer GEMM for wide inputs if it exists here, matches the reference
        (`_agrees`, the activations' rounding counted) and is timed faster than the packed
        kernel for this shape (`_wide_pays`)."""
        probe = torch.randn(WIDE_ROWS + 3, self.in_features, generator=torch.Generator().manual_seed(1)).to(self.dtype)
        try:
            got = self._wide(probe)
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            return
        want = F.linear(probe, reference).float()
        self.wide = _agrees(got, want) and _wide_pays(self)

    def _wide(self, x2: torch.Tensor) -> torch.Tensor:
        """[M, K] float activations -> [M, N] float32: x quantised per row, int8 x int8 -> int32."""
        x2 = x2.float()
        sx = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        xq = torch.round(x2 / sx).to(torch.int8)
        return torch._int_mm(xq, self.data.t()).float() * sx * self.scale.float()

    def _scale_zeros(self) -> torch.Tensor:
        zero = self.minimum + 8 * self.scale  # the kernels compute (q - 8) * scale + zero
        return torch.stack((self.scale, zero), dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)

    def _pack_int4_kernel(self, q: torch.Tensor) -> torch.Tensor:
        if q.device.type == "cuda":
            # CUDA's packer takes two values per byte, the even column in the high nibble
            return torch._convert_weight_to_int4pack(((q[:, 0::2] << 4) | q[:, 1::2]).contiguous(), _INNER_K_TILES)
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)

    def dequantize(self) -> torch.Tensor:
        """The matrix the draft computes with, [N, K] in the compute dtype."""
        if self.scheme == "int4" and self.backend == "kernel":
            raise ValueError("an int4 weight in the kernel's packed layout is not dequantised")
        if self.scheme == "int8":
            return dequantize_int8(self.data, self.scale).to(self.dtype)
        return dequantize_int4(self.data, self.scale, self.minimum).to(self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend == "dequant":
            return F.linear(x, self.dequantize(), bias)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.wide and x2.shape[0] >= WIDE_ROWS:
            y = self._wide(x2).reshape(*shape[:-1], self.out_features).to(x.dtype)
            return y + bias if bias is not None else y
        x2 = x2.to(KERNEL_DTYPE)
        if self.scheme == "int8":
            y = torch._weight_int8pack_mm(x2, self.data, self.scale)
        elif x2.device.type == "cuda":
            y = torch._weight_int4pack_mm(x2, self.data, self.group_size, self.scale_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.data, self.group_size, self.scale_zeros)
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y + bias if bias is not None else y

    def nbytes(self) -> int:
        parts = {id(t): t for t in (self.data, self.scale, self.minimum, self.scale_zeros) if t is not None}
        return sum(t.numel() * t.element_size() for t in parts.values())


def _best_of(fn, repeats: int = 3) -> float:
    fn()  # (first call: allocations, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _wide_pays(ql: QuantizedLinear) -> bool:
    """Whether the CPU's integer GEMM beats the packed int8 kernel for a matrix of `ql`'s shape
    on WIDE_PROBE_ROWS rows (both paths as `linear` runs them, activations' quantisation and
    casts included), timed once per shape and process."""
    key = (ql.out_features, ql.in_features)
    if key not in _WIDE_PAYS:
        x = torch.randn(WIDE_PROBE_ROWS, ql.in_features, generator=torch.Generator().manual_seed(2)).to(ql.dtype)
        gemm = _best_of(lambda: ql._wide(x))
        packed = _best_of(lambda: torch._weight_int8pack_mm(x.to(KERNEL_DTYPE), ql.data, ql.scale))
        _WIDE_PAYS[key] = gemm < packed
    return _WIDE_PAYS[key]


def quantized_bytes(out_features: int, in_features: int, scheme: str, group_size: int) -> int:
    """Bytes one quantised matrix holds in the kernel layout (the default backend), for the
    placement plan: int8 values and a bfloat16 scale per row; int4 values two per byte and a
    bfloat16 (scale, zero) pair per group. A weight that falls back to "dequant" keeps float32
    scales instead: 2 more bytes per row (int8) or 4 more per group (int4)."""
    if scheme == "int8":
        return out_features * in_features + 2 * out_features
    return out_features * in_features // 2 + 4 * out_features * (in_features // group_size)
