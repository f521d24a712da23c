"""The CPU fast path of GGUF dequantization: gguf_native.c, compiled once per machine.

Streaming a quantized model on the CPU means dequantizing every streamed layer on every pass, and
torch's vectorized ops make several passes over memory per block (unpack nibbles, multiply, add):
measured on this project's 2-vCPU machine, about 3 ns a weight for Q4_1, more than reading the
float32 bytes from its disk costs. The C loop reads each block once and writes its floats once.

It is built with the machine's C compiler (`cc`, or $CC) into the cache folder the first time it
is needed (a temporary file renamed into place; keyed by the source, the compiler and the CPU),
and loaded with ctypes, which releases the GIL during a call. Without a compiler, or with
SEQUOIA_OFFLOAD_NATIVE=0, `available()` is False and the torch path runs: the same values
either way (tests/test_gguf_blocks.py compares them bit for bit).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

from ..fsutil import cache_root

SOURCE = Path(__file__).with_name("gguf_native.c")
KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
# 16-bit floats widened to float32 (a layer stored in f16/bf16, computed in float32): also the C
# loop's, so that the layer loader never converts with torch (runtime/streamer.py)
FLOAT_KINDS = {"F16": 8, "BF16": 9}
_ALL_KINDS = {**KINDS, **FLOAT_KINDS}
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-pthread", "-shared", "-fPIC"]
THREADS = max(1, min(2, os.cpu_count() or 1))

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build(flags: list[str] = FLAGS) -> ctypes.CDLL:
    """The library compiled with `flags` (cached by source, compiler, CPU and flags), loaded."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) found")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + _cpu_id().encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    folder = cache_root() / "native"
    lib = folder / f"gguf_native-{key}.so"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{lib.name}.tmp-{os.getpid()}"
        try:
            proc = subprocess.run([cc, *flags, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                raise OSError(f"{cc} failed: {proc.stderr.strip()[-300:]}")
            os.replace(tmp, lib)
        finally:
            tmp.unlink(missing_ok=True)
    handle = ctypes.CDLL(str(lib))
    handle.dequantize_many.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                       ctypes.c_int]
    handle.dequantize_many.restype = ctypes.c_int
    return handle


def available() -> bool:
    """Whether the compiled library is (or can now be) loaded; builds it on the first call."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib is not None
    with _lock:
        if not _tried:
            if os.environ.get("SEQUOIA_OFFLOAD_NATIVE", "1") == "0":
                _why_not = "SEQUOIA_OFFLOAD_NATIVE=0"
            else:
                try:
                    _lib = _build()
                except Exception as e:  # noqa: BLE001 - any failure means the torch path, said once
                    _why_not = str(e)
                    print(f"sequoia-offload: note: the compiled GGUF dequantizer is unavailable ({e}); "
                          "using torch ops (same values, slower on the CPU)", file=sys.stderr)
            _tried = True
    return _lib is not None


def why_not() -> str:
    return _why_not


def _blocks(data: torch.Tensor, qtype: str, out: torch.Tensor, block: int, size: int) -> int | None:
    """How many blocks `data` holds, or None where the fast path does not apply."""
    if (qtype not in _ALL_KINDS or data.device.type != "cpu" or out.device.type != "cpu"
            or out.dtype != torch.float32 or not data.is_contiguous() or not out.is_contiguous()):
        return None
    n = data.numel() // size
    if n * size != data.numel() or n * block != out.numel():
        raise ValueError(f"{qtype}: {data.numel()} bytes do not fill {out.numel()} weights")
    return n


def dequantize_into(data: torch.Tensor, qtype: str, out: torch.Tensor, block: int, size: int) -> bool:
    """Blocks of `qtype` (`block` weights in `size` bytes each; uint8, contiguous, CPU) into `out`
    (float32, contiguous, CPU, as many weights as the blocks hold); False (nothing done) where the
    fast path does not apply."""
    return dequantize_many([(data, qtype, out, block, size)])


def dequantize_many(items: list[tuple[torch.Tensor, str, torch.Tensor, int, int]]) -> bool:
    """Several tensors at once, each (data, qtype, out, block, size) as in `dequantize_into`, their
    blocks split between THREADS threads (a layer's tensors together: one tensor of a small model
    is too little work to pay for starting a thread); False (nothing done) where the fast path
    does not apply to one of them."""
    if not items or not available():
        return False
    counts = [_blocks(*item) for item in items]
    if None in counts:
        return False
    tensors = [(data.data_ptr(), out.data_ptr(), n, qtype) for (data, qtype, out, *_), n in zip(items, counts)]
    if run_many(_lib, tensors, THREADS) != 0:
        raise ValueError(f"{', '.join(sorted({q for _, q, *_ in items}))}: the compiled dequantizer refused the format")
    return True


def run_many(lib: ctypes.CDLL, tensors: list[tuple[int, int, int, str | int]], threads: int) -> int:
    """The compiled `dequantize_many` of `lib` on (source address, destination address, blocks,
    format name or kind number) per tensor, unchecked; its return code (0, or -1 for a bad kind
    or count). `dequantize_many` above is the checked entry point."""
    k = len(tensors)
    srcs = (ctypes.c_void_p * k)(*(src for src, *_ in tensors))
    dsts = (ctypes.c_void_p * k)(*(dst for _, dst, *_ in tensors))
    counts = (ctypes.c_int64 * k)(*(n for _, _, n, _ in tensors))
    kinds = (ctypes.c_int * k)(*(_ALL_KINDS.get(kind, kind) for *_, kind in tensors))
    return lib.dequantize_many(srcs, dsts, counts, kinds, k, threads)
