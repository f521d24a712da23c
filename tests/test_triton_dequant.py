"""The GPU's fused dequantization kernels (runtime/triton_dequant.py) checked on the CPU under
Triton's interpreter: every format, shapes of one to many blocks (the last program partly masked),
and float32 / bfloat16 outputs (float16 takes float32's store path; the GPU test covers it), each bitwise the CPU dequantization cast to that dtype.
On a GPU, tests/test_cuda.py runs the compiled kernels against the same reference."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECK = r'''
import numpy as np, torch
from gguf import quants, GGMLQuantizationType as T
from offload_engine.formats import gguf_blocks
from offload_engine.runtime import triton_dequant
K = {"Q4_K": [(0, 2), (2, 4)], "Q5_K": [(0, 2), (2, 4)], "Q6_K": [(208, 210)]}
rng = np.random.default_rng(0)
bad, checked = [], 0
for qt in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]:
    per, size = gguf_blocks.BLOCK_SIZES[qt]
    for rows, cols in [(1, per), (3, per * 2), (33, per * 3)]:
        if qt in K:
            n = rows * cols // per
            raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
            for lo, hi in K[qt]:
                raw[:, lo:hi] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
        else:
            w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
            raw = quants.quantize(w, T[qt])
        data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
        ref = gguf_blocks.dequantize(data, qt, (rows, cols))
        for dt, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):  # float16 casts as float32 stores
            out = torch.full((rows, cols), float("nan"), dtype=dt)
            assert triton_dequant.dequantize_into(data, qt, out)
            checked += 1
            if not torch.equal(out.view(bits), ref.to(dt).view(bits)):
                bad.append((qt, rows, cols, str(dt)))
print("checked", checked, "bad", bad)
assert not bad and checked == 8 * 3 * 2
'''


def test_fused_kernels_equal_the_cpu_dequantization_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed here (it ships with torch's CUDA builds)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "checked 48 bad []" in proc.stdout
