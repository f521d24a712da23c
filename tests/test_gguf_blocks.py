"""GGUF block formats dequantized as torch (formats/gguf_blocks.py) against the `gguf` package's
reference dequantization, bitwise, for every supported type. Test tensors are written by the
gguf package's quantizers where it has them; for the K-quants, random blocks whose half-precision
scale fields are finite are valid blocks."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from offload_engine.formats import gguf_blocks

QUANTIZED = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_QUANTS = {"Q4_K": [(0, 2), (2, 4)], "Q5_K": [(0, 2), (2, 4)], "Q6_K": [(208, 210)]}  # f16 fields per block


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _random_blocks(rng, qtype: str, n: int) -> torch.Tensor:
    """n blocks of `qtype` with random codes and small random scales (finite weights)."""
    size = gguf_blocks.BLOCK_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for lo, hi in K_QUANTS.get(qtype, [(0, 2), (2, 4)] if qtype in ("Q4_1", "Q5_1") else [(0, 2)]):
        raw[:, lo:hi] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    return torch.from_numpy(raw.reshape(-1).copy())


def _check(raw: np.ndarray, qtype: str, shape):
    want = quants.dequantize(raw, T[qtype]).reshape(shape)
    got = gguf_blocks.dequantize(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy()),
                                 qtype, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(shape)
    np.testing.assert_array_equal(_bits(got.numpy()), _bits(want))


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("shape", [(3, 64), (5, 256), (1, 32)])
def test_equals_the_gguf_reference_for_quantized_weights(qtype, shape):
    rng = np.random.default_rng(hash((qtype, shape)) % 2**32)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3, (shape[0], 1))).astype(np.float32)
    w[0, :4] = [0.0, -0.0, 1e-8, -7.5]
    raw = quants.quantize(w, T[qtype])
    assert raw.nbytes == gguf_blocks.nbytes(qtype, w.size)
    _check(raw, qtype, shape)


@pytest.mark.parametrize("qtype", list(K_QUANTS))
@pytest.mark.parametrize("rows", [1, 3])
def test_equals_the_gguf_reference_for_random_k_quant_blocks(qtype, rows):
    block, size = gguf_blocks.BLOCK_SIZES[qtype]
    rng = np.random.default_rng(rows * 7 + len(qtype))
    n_blocks = rows * 2
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for lo, hi in K_QUANTS[qtype]:  # finite scales: random halves in a sane range
        raw[:, lo:hi] = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    _check(raw.reshape(rows, -1), qtype, (rows, 2 * block))


def test_f32_is_its_own_bytes():
    w = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    _check(w.view(np.uint8), "F32", (2, 8))


def test_sizes_match_the_gguf_package():
    from gguf.constants import GGML_QUANT_SIZES
    for name, sizes in gguf_blocks.BLOCK_SIZES.items():
        assert GGML_QUANT_SIZES[T[name]] == sizes, name
    assert gguf_blocks.bits_per_weight("Q4_0") == 4.5 and gguf_blocks.bits_per_weight("Q6_K") == 6.5625


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="IQ2_XS is not supported.*Q4_K"):
        gguf_blocks.dequantize(torch.zeros(10, dtype=torch.uint8), "IQ2_XS", (1, 256))
    with pytest.raises(ValueError, match="needs 36 bytes, got 35"):
        gguf_blocks.dequantize(torch.zeros(35, dtype=torch.uint8), "Q4_0", (2, 32))
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        gguf_blocks.nbytes("Q4_K", 300)


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("qtype", QUANTIZED + list(K_QUANTS) + ["F32"])
def test_dequantize_into_equals_dequantize(qtype, native):
    """The streaming path's dequantization (`dequantize_into`: the compiled loop, or fewer torch
    passes) against the plain one, on blocks with every code and scale pattern at random."""
    rng = np.random.default_rng(len(qtype))
    block, size = gguf_blocks.BLOCK_SIZES[qtype]
    shape = (3, 40 * max(block, 32))  # 120 blocks or more
    if qtype in K_QUANTS:
        n = shape[0] * shape[1] // block
        raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
        for lo, hi in K_QUANTS[qtype]:
            raw[:, lo:hi] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    elif qtype == "F32":
        raw = rng.standard_normal(shape).astype(np.float32)
    else:
        raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), T[qtype])
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    want = gguf_blocks.dequantize(data, qtype, shape)
    out = torch.full(shape, float("nan"))
    gguf_blocks.dequantize_into(data, qtype, out, native=native)
    np.testing.assert_array_equal(_bits(out.numpy()), _bits(want.numpy()))


def test_the_compiled_dequantizer_is_built_where_a_compiler_is():
    """This project's machines have a C compiler: the fast path must be there, not silently off."""
    import shutil

    from offload_engine.formats import gguf_native
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the torch path runs (tested above)")
    assert gguf_native.available(), gguf_native.why_not()


def test_compiled_half_conversion_is_exact_for_every_half():
    """Q8_0 blocks whose codes are all 1 hold their scale as every weight: for all 65,536 halves
    (subnormals, infinities and NaNs) the weights are the gguf package's (whose multiplication
    by the code makes a signalling NaN quiet, as ours does). Many blocks: the threaded branch."""
    from offload_engine.formats import gguf_native
    if not gguf_native.available():
        pytest.skip(f"compiled dequantizer unavailable here: {gguf_native.why_not()}")
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    blocks = np.zeros((2**16, 34), dtype=np.uint8)
    blocks[:, :2] = halves.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = 1
    out = torch.empty(2**16 * 32)
    assert gguf_native.dequantize_into(torch.from_numpy(blocks.reshape(-1)), "Q8_0", out, 32, 34)
    want = quants.dequantize(blocks, T.Q8_0).reshape(-1)
    np.testing.assert_array_equal(_bits(out.numpy()), _bits(want))


def test_the_portable_build_of_the_compiled_loop_equals_the_torch_path():
    """Built without -march=native (no F16C, no AVX2: the scalar code a CPU without them runs,
    which the native build on this machine never does), every format against the torch path."""
    from offload_engine.formats import gguf_native
    if not gguf_native.available():
        pytest.skip(f"compiled dequantizer unavailable here: {gguf_native.why_not()}")
    lib = gguf_native._build([f for f in gguf_native.FLAGS if not f.startswith("-march")])
    rng = np.random.default_rng(7)
    for qtype in gguf_native.KINDS:
        block, size = gguf_blocks.BLOCK_SIZES[qtype]
        n = 300
        data = _random_blocks(rng, qtype, n)
        data[:2] = torch.from_numpy(np.frombuffer(np.float16(6e-8).tobytes(), np.uint8).copy())  # a subnormal scale
        out = torch.full((n * block,), float("nan"))
        assert gguf_native.run_many(lib, [(data.data_ptr(), out.data_ptr(), n, qtype)], 1) == 0
        want = gguf_blocks.dequantize_into(data, qtype, torch.empty(n * block), native=False)
        np.testing.assert_array_equal(_bits(out.numpy()), _bits(want.numpy()), err_msg=qtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_layers_tensors_at_once_equal_each_alone(threads):
    """The streamer hands the compiled loop a whole layer (`dequantize_many`), whose blocks are
    split between threads across the tensors' boundaries: over tensors of 20,000, 30,000 and 1,125
    blocks (51,125 in all, over the one-thread threshold of 32,768), 2 threads cut inside the
    second tensor, 3 threads inside the first and the second, and the last share runs across the
    second and third. Every weight equals the torch path's, bit for bit."""
    from offload_engine.formats import gguf_native
    if not gguf_native.available():
        pytest.skip(f"compiled dequantizer unavailable here: {gguf_native.why_not()}")
    rng = np.random.default_rng(threads)
    items, wants = [], []
    for qtype, n in (("Q4_1", 20000), ("Q8_0", 30000), ("Q4_K", 9000 // 8)):
        block, size = gguf_blocks.BLOCK_SIZES[qtype]
        data = _random_blocks(rng, qtype, n)
        items.append((data, qtype, torch.full((n * block,), float("nan")), block, size))
        wants.append(gguf_blocks.dequantize_into(data, qtype, torch.empty(n * block), native=False))
    tensors = [(d.data_ptr(), o.data_ptr(), d.numel() // size, q) for d, q, o, _, size in items]
    assert gguf_native.run_many(gguf_native._lib, tensors, threads) == 0
    for (_, qtype, out, _, _), want in zip(items, wants):
        np.testing.assert_array_equal(_bits(out.numpy()), _bits(want.numpy()), err_msg=qtype)
    # the Python entry point (THREADS threads), on fresh outputs
    for item in items:
        item[2].fill_(float("nan"))
    assert gguf_native.dequantize_many(items)
    for (_, qtype, out, _, _), want in zip(items, wants):
        np.testing.assert_array_equal(_bits(out.numpy()), _bits(want.numpy()), err_msg=qtype)


def test_the_compiled_loop_does_not_use_openmp():
    """The layer loader thread calls the compiled loop while torch computes on another thread. An
    OpenMP parallel region entered from the loader leaves libgomp (torch's, shared by soname) a
    second thread team, and while it lives torch's workers stop spinning between regions: on a
    2-vCPU machine every small matmul of the compute thread ran 2-4x slower (gguf_native.c's
    `dequantize_many`). The library must not import any OpenMP entry point."""
    import shutil
    import subprocess

    from offload_engine.formats import gguf_native
    if not gguf_native.available():
        pytest.skip(f"compiled dequantizer unavailable here: {gguf_native.why_not()}")
    nm = shutil.which("nm")
    assert nm is not None, "nm (binutils, beside the C compiler) is needed to read the library's symbols"
    path = gguf_native._lib._name
    undefined = subprocess.run([nm, "-D", "--undefined-only", path], capture_output=True, text=True,
                               check=True).stdout.split()
    assert not [s for s in undefined if s.startswith(("GOMP_", "omp_"))], path
    assert any(s.startswith("pthread_create") for s in undefined), undefined  # the threads it does use


@pytest.mark.parametrize("fmt", ["F16", "BF16"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_the_compiled_loop_widens_every_16_bit_float_as_torch_does(fmt, portable):
    """A layer stored in f16/bf16 and computed in float32 is widened by the compiled loop on the
    loader thread (a torch conversion there would start a second OpenMP team): every 16-bit value
    but the last three, subnormals and infinities included, bit for bit as torch's `.float()`, in
    the native build (F16C) and the portable one; an odd count exercises the scalar tail. A NaN
    stays a NaN: torch's own bits for one differ between its vector loop (a signalling half made
    quiet) and its scalar tail (the sign and payload not always kept)."""
    from offload_engine.formats import gguf_native
    if not gguf_native.available():
        pytest.skip(f"compiled dequantizer unavailable here: {gguf_native.why_not()}")
    lib = gguf_native._build([f for f in gguf_native.FLAGS if not f.startswith("-march")]) if portable \
        else gguf_native._lib
    n = 2**16 - 3
    raw = torch.arange(n, dtype=torch.int32).to(torch.int16)
    want = raw.view(getattr(torch, {"F16": "float16", "BF16": "bfloat16"}[fmt])).float()
    out = torch.full((n,), float("nan"))
    assert gguf_native.run_many(lib, [(raw.data_ptr(), out.data_ptr(), n, fmt)], 2) == 0
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(out), nan)
    np.testing.assert_array_equal(_bits(out[~nan].numpy()), _bits(want[~nan].numpy()))


def test_an_unknown_kind_or_count_writes_nothing():
    """The compiled loop checks every tensor's kind and count before it writes any: a bad last
    tensor leaves the first one's output untouched."""
    from offload_engine.formats import gguf_native
    if not gguf_native.available():
        pytest.skip(f"compiled dequantizer unavailable here: {gguf_native.why_not()}")
    data = _random_blocks(np.random.default_rng(0), "Q8_0", 40000)
    out = torch.full((40000 * 32,), float("nan"))
    for kind, count in ((99, 10), (0, -1)):
        tensors = [(data.data_ptr(), out.data_ptr(), 40000, "Q8_0"), (data.data_ptr(), out.data_ptr(), count, kind)]
        assert gguf_native.run_many(gguf_native._lib, tensors, 2) == -1
        assert torch.isnan(out).all()
