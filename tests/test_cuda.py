"""CUDA paths of the executor (run with `pytest -m cuda` on a machine with an NVIDIA GPU;
`make test` deselects them). Without a GPU these fail loudly rather than skip."""

import time

import pytest
import torch

from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.loader import OffloadOptions, load_target
from offload_engine.runtime.model import Transformer
from test_streaming import BATCH, LAYERS, plan_for, run_script
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    assert torch.cuda.is_available(), "the cuda tests need an NVIDIA GPU"
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("cuda") / "m", "llama3-gqa", layers=LAYERS,
                                  init_std=0.1)
    return Checkpoint(folder, load_config(folder))


def _on_cuda(outs):
    return [o.cpu() for o in outs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offload,buffers,resident,ram_layers", [
    ("ram", 1, 0, 4), ("ram", 2, 0, 4), ("ram", 3, 0, 4), ("disk", 2, 0, 0), ("disk", 3, 0, 0), ("auto", 2, 1, 2)])
def test_streamed_equals_resident_on_cuda(ckpt, tmp_path, dtype, offload, buffers, resident, ram_layers):
    reference = Transformer.from_checkpoint(ckpt, dtype, CUDA)
    plan = plan_for(ckpt, offload, buffers, resident, ram_layers, dtype)  # (its bytes per pass are dtype's)
    model = load_target(ckpt, dtype, CUDA, plan, OffloadOptions(offload, buffers=buffers, store_root=tmp_path),
                        progress=False)
    ex = model.layers
    try:
        for block in ex.ram_blocks.values():
            assert block.is_pinned()
        for block in getattr(ex, "staging", []):  # O_DIRECT targets: page-aligned and registered
            assert block.data_ptr() % 4096 == 0 and block.is_pinned()
        if plan.streamed_layers:
            assert ex.copy_stream != torch.cuda.current_stream()
        expected = _on_cuda(run_script(reference, ckpt.config.vocab_size, device=CUDA))
        got = _on_cuda(run_script(model, ckpt.config.vocab_size, device=CUDA))
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        stats = ex.snapshot()
        assert stats.bytes_streamed == len(expected) * plan.bytes_per_pass
    finally:
        ex.close()


def test_slow_copies_and_slow_compute_still_give_equal_logits(ckpt, tmp_path, monkeypatch):
    """Stretch both sides with GPU sleeps so that a missing ready/free wait would show: compute
    reading a buffer before its copy landed, or a copy overwriting a buffer still being read."""
    from offload_engine.runtime import streamer
    import offload_engine.runtime.model as model_mod
    reference = _on_cuda(run_script(Transformer.from_checkpoint(ckpt, torch.float32, CUDA),
                                    ckpt.config.vocab_size, device=CUDA))
    real_fill, real_layer = streamer.LayerExecutor._fill, model_mod.decoder_layer

    def slow_fill(self, layer, b, *args):
        self.copy_stream.wait_event(self.free_events[b])
        with torch.cuda.stream(self.copy_stream):
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the copy
        return real_fill(self, layer, b, *args)

    def slow_layer(*args, **kwargs):
        out = real_layer(*args, **kwargs)
        torch.cuda._sleep(2_000_000)  # the compute stream keeps reading the layer's buffer longer
        return out

    monkeypatch.setattr(streamer.LayerExecutor, "_fill", slow_fill)
    monkeypatch.setattr(model_mod, "decoder_layer", slow_layer)
    for offload, ram_layers in (("ram", 4), ("disk", 0)):
        plan = plan_for(ckpt, offload, 2, 0, ram_layers)
        model = load_target(ckpt, torch.float32, CUDA, plan,
                            OffloadOptions(offload, store_root=tmp_path), progress=False)
        try:
            for a, b in zip(_on_cuda(run_script(model, ckpt.config.vocab_size, device=CUDA)), reference):
                assert torch.equal(a, b), offload
        finally:
            model.layers.close()


@pytest.mark.parametrize("offload,ram_layers", [("ram", 4), ("disk", 0)])
def test_no_device_wide_synchronize_inside_a_pass(ckpt, tmp_path, monkeypatch, offload, ram_layers):
    plan = plan_for(ckpt, offload, 2, 0, ram_layers)
    model = load_target(ckpt, torch.bfloat16, CUDA, plan, OffloadOptions(offload, store_root=tmp_path),
                        progress=False)
    calls = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append("device"), real_sync(*a, **k)))
    real_stream_sync = torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: (calls.append("stream"), real_stream_sync(self)))
    try:
        ids = torch.arange(BATCH, device=CUDA) % ckpt.config.vocab_size
        cache = model.new_cache(4 * BATCH)
        if offload == "ram":  # implicit synchronisations (.item(), pageable copies) raise here
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                model.forward(ids, torch.arange(BATCH, device=CUDA), cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert calls == []
        real_sync()
    finally:
        model.layers.close()


def test_abandoned_pass_on_cuda_restarts_cleanly(ckpt, tmp_path):
    reference = _on_cuda(run_script(Transformer.from_checkpoint(ckpt, torch.float32, CUDA),
                                    ckpt.config.vocab_size, device=CUDA))
    plan = plan_for(ckpt, "disk", 2)
    model = load_target(ckpt, torch.float32, CUDA, plan, OffloadOptions("disk", store_root=tmp_path),
                        progress=False)
    try:
        with pytest.raises(RuntimeError):  # a mask of the wrong shape fails inside layer 0
            model.forward(torch.tensor([1, 2], device=CUDA), torch.arange(2, device=CUDA), model.new_cache(8),
                          mask=torch.ones(3, 3, dtype=torch.bool, device=CUDA))
        for a, b in zip(_on_cuda(run_script(model, ckpt.config.vocab_size, device=CUDA)), reference):
            assert torch.equal(a, b)
    finally:
        model.layers.close()


@pytest.mark.parametrize("kind", ["sequoia", "specexec", "chain"])
def test_speculative_greedy_equals_plain_greedy_on_cuda(ckpt, tmp_path, monkeypatch, kind):
    from offload_engine import Engine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    plain = Engine.load(ckpt.folder, device="cuda", dtype="float32", offload="ram", progress=False)
    spec = Engine.load(ckpt.folder, device="cuda", dtype="float32", offload="ram", draft=ckpt.folder, tree=kind,
                       tree_budget=16, tree_depth=4, progress=False)
    try:
        for engine in (plain, spec):
            engine.eos_token_ids = frozenset()
        expected = plain.generate("The capital of France is", max_new_tokens=24).token_ids
        got = spec.generate("The capital of France is", max_new_tokens=24)
        assert got.token_ids == expected and got.stats["tokens_per_step"] > 1.5
        sampled = spec.generate("The capital of France is", max_new_tokens=8, temperature=0.7, seed=3)
        assert len(sampled.token_ids) == 8
    finally:
        plain.close()
        spec.close()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_self_draft_kernels_on_cuda(scheme):
    """The packed CUDA kernels agree with the dequantised matmul to bfloat16 precision; the int4
    one (tinygemm, sm80+) must take the weight rather than fall back. Whether torch has a CUDA
    int8 kernel depends on its version: a fallback there is reported, not failed."""
    from offload_engine.runtime.quant import QuantizedLinear
    assert torch.cuda.is_available(), "the cuda tests need an NVIDIA GPU"
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1)).to(CUDA, torch.bfloat16)
    kernel = QuantizedLinear.from_weight(w, scheme, 64, torch.bfloat16, CUDA, backend="kernel")
    dequant = QuantizedLinear.from_weight(w, scheme, 64, torch.bfloat16, CUDA, backend="dequant")
    if scheme == "int4" and torch.cuda.get_device_capability() >= (8, 0):
        assert kernel.backend == "kernel"
    print(f"{scheme}: backend {kernel.backend}")
    want = (x.float() @ dequant.dequantize().float().T)
    got = kernel.linear(x).float()
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


@pytest.mark.parametrize("draft", ["self-int8", "self-int4"])
def test_self_draft_greedy_equals_plain_on_cuda(ckpt, tmp_path, monkeypatch, draft):
    from tiny_models import greedy_past_eos
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = greedy_past_eos(ckpt.folder, "The capital of France is", 32, device="cuda")[0].token_ids
    spec = greedy_past_eos(ckpt.folder, "The capital of France is", 32, device="cuda", tree="sequoia", draft=draft,
                           draft_group_size=32, offload="ram", tree_budget=16, tree_depth=5)[0]
    assert spec.token_ids == want



@pytest.mark.parametrize("draft", ["self-q4", "self-q8"])
def test_substitute_draft_with_overlap_equals_plain_on_cuda(ckpt, tmp_path, monkeypatch, draft):
    """Issue 23 on the device: the substitute draft on the target's KV cache, with the next tree
    grown during the streamed pass (on) and without (off), gives plain greedy's tokens; and after
    every step of a decoder on it the shared cache holds exactly the target's committed K/V."""
    from offload_engine import Engine
    from offload_engine.speculation.decoder import SpeculativeDecoder
    from sequoia_trees.sampling import SamplingParams
    from tiny_models import greedy_past_eos
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prompt = "The capital of France is"
    want = greedy_past_eos(ckpt.folder, prompt, 32, device="cuda", dtype="float32")[0].token_ids
    for overlap in ("on", "off"):
        got = greedy_past_eos(ckpt.folder, prompt, 32, device="cuda", dtype="float32", tree="sequoia", draft=draft,
                              draft_group_size=32, offload="disk", buffers=2, tree_budget=16, tree_depth=5,
                              overlap=overlap)[0]
        assert got.token_ids == want, overlap
    engine = Engine.load(ckpt.folder, device="cuda", dtype="float32", draft=draft, draft_group_size=32, offload="disk",
                         tree="sequoia", tree_budget=16, tree_depth=5, progress=False)
    try:
        ids = engine.tokenizer.encode(prompt)
        dec = SpeculativeDecoder(engine.model, engine.draft, engine.tree, SamplingParams(0.0),
                                 torch.Generator().manual_seed(0), 256, overlap="eager")
        assert dec.draft_cache.k is dec.target_cache.k
        root = dec.first_token(dec.prefill(ids, 1024))
        seq = list(ids)
        for _ in range(8):
            step = dec.step(root)
            seq += [root] + step.tokens[:-1]
            root = step.tokens[-1]
            n = len(seq)
            assert dec.target_cache.length == n
            fresh = engine.model.new_cache(n)
            engine.model.forward(torch.tensor(seq, device=CUDA), torch.arange(n, device=CUDA), fresh)
            torch.testing.assert_close(dec.target_cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-3, rtol=1e-2)
            torch.testing.assert_close(dec.target_cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-3, rtol=1e-2)
        # --overlap auto's gate on the device: steps timed, the overrun read from CUDA events
        # after each pass (`LayerExecutor._collect`); the output is still plain greedy's
        from offload_engine.planning.adaptive import OverlapGate
        from offload_engine.runtime import streamer
        fill = streamer.LayerExecutor._fill

        def slow(self, *args):  # (every layer's copy queued 10 ms late: the passes wait, and grow)
            time.sleep(0.01)
            return fill(self, *args)
        monkeypatch.setattr(streamer.LayerExecutor, "_fill", slow)
        work = engine.model.layers.snapshot().idle_work_seconds
        gate = OverlapGate()
        dec = SpeculativeDecoder(engine.model, engine.draft, engine.tree, SamplingParams(0.0),
                                 torch.Generator().manual_seed(0), 256, overlap=True, timed=True, ahead_gate=gate)
        root = dec.first_token(dec.prefill(ids, 1024))
        out = [root]
        while len(out) < 32:
            step = dec.step(out[-1])
            out += step.tokens
        assert out[:32] == want[:32]
        assert gate.grown_steps >= 1, gate.counts()  # (its events resolved: no error reading them)
        assert engine.model.layers.snapshot().idle_work_seconds > work
    finally:
        engine.close()

# ---- the speculation step on the device (issue 17) -------------------------------------------

def _tiny_pair_on(device, root):
    from test_speculative_distribution import tiny
    from tiny_models import perturbed_copy
    target = tiny(root / "target", 1)
    draft = perturbed_copy(target, root / "draft", 0.6, 5, sharpen=2.0)
    return [Transformer.from_checkpoint(Checkpoint(p, load_config(p)), torch.float32, device) for p in (target, draft)]


@pytest.mark.parametrize("backend", ["efficient", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_backends_equal_sdpa_on_cuda(backend, dtype):
    from offload_engine.runtime import attention
    g = torch.Generator().manual_seed(0)
    for S, T in ((1, 300), (7, 40), (129, 600)):
        q = torch.randn(1, 64, S, 128, generator=g).to(CUDA, dtype)
        k, v = (torch.randn(1, 8, T, 128, generator=g).to(CUDA, dtype) for _ in range(2))
        mask = (torch.rand(S, T, generator=g) < 0.7)
        mask[:, 0] = True
        mask = mask.to(CUDA)[None, None]
        want = attention.attend(q.float(), k.float(), v.float(), mask, "sdpa")
        got = attention.attend(q, k, v, mask, backend).float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_captured_draft_levels_equal_eager_ones(tmp_path):
    """A replayed CUDA graph gives the eager padded pass's logits and K/V, for every bucket it is
    captured at and at different cache offsets (the slots and masks are buffer values)."""
    from offload_engine.runtime.draft_graphs import StaticLevels
    _, draft = _tiny_pair_on(CUDA, tmp_path)
    caches = [draft.new_cache(200) for _ in range(2)]
    runners = [StaticLevels(draft, caches[0], capture=False), StaticLevels(draft, caches[1], capture=True)]
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 8, (20,), generator=g).to(CUDA)
    for c in caches:
        draft.forward(prefix, torch.arange(20, device=CUDA), c)
        c.advance(20)
    base = 20
    for w in (1, 3, 8, 5, 3, 17):  # buckets 1, 4, 8 again, 32, and a replay of 4 at a new offset
        tokens = torch.randint(0, 8, (w,), generator=g).to(CUDA)
        n = caches[0].length + w - base
        tree_mask = (torch.rand(w, n, generator=g) < 0.5).to(CUDA)
        tree_mask[:, 0] = True
        positions = torch.arange(w, device=CUDA) + caches[0].length
        outs = [r.run(tokens, positions, tree_mask, base) for r in runners]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)
        for c in caches:
            c.advance(w)
        end = caches[0].length
        torch.testing.assert_close(caches[1].k[:, :, :, :end], caches[0].k[:, :, :, :end], atol=1e-5, rtol=1e-4)
    assert runners[1].replays == 6 and runners[1].capture, "the graphs were not used"


@pytest.mark.parametrize("kind", ["sequoia", "specexec", "specinfer", "chain"])
def test_device_path_gives_the_cpu_paths_greedy_tokens(tmp_path, kind):
    """On the GPU, the device path (children picked on the device, table verification, graphed
    draft levels) against the CPU path's modes (host walk, plain draft passes) and plain greedy."""
    from test_draft_graphs import KINDS, _generate
    from sequoia_trees.sampling import SamplingParams
    from offload_engine.speculation.decoder import TreeSpec
    target, draft = _tiny_pair_on(CUDA, tmp_path)
    plain, _ = _generate(target, None, TreeSpec(), ("walk", "off"), SamplingParams())
    device, dec = _generate(target, draft, KINDS[kind], ("table", "on"), SamplingParams())
    host, _ = _generate(target, draft, KINDS[kind], ("walk", "off"), SamplingParams())
    assert device == host == plain
    assert dec.draft_levels.replays > 0


@pytest.mark.parametrize("kind", ["sequoia", "specexec"])
def test_sampled_first_two_tokens_on_cuda_have_the_target_distribution(tmp_path, kind):
    """test_speculative_distribution's chi-square test (same fixture, sample sizes, threshold and
    power), on the GPU with the decoder's GPU defaults: children drawn by Gumbel top-k from a CUDA
    generator, table verification, graphed draft levels. One static kind and the best-first one
    (the two ways a tree grows on the device), to keep the device check within its minutes."""
    import test_speculative_distribution as dist
    target, draft = _tiny_pair_on(CUDA, tmp_path)
    counts, _ = dist.sample_two_tokens(target, draft, dist.SPECS[kind], dist.SAMPLES[kind], seed=17)
    exact = dist.exact_joint(target, dist.PROMPT + [dist.ROOT])
    p = dist.p_values(counts, exact)
    assert min(p.values()) > dist.ALPHA / 2, p


def test_a_broken_table_verifier_fails_on_cuda(tmp_path, monkeypatch):
    """Negative control for the test above: SpecExec's extra draws dropped from the table."""
    import offload_engine.speculation.decoder as decoder
    import test_speculative_distribution as dist
    from sequoia_trees.verify import verify_stochastic_table
    target, draft = _tiny_pair_on(CUDA, tmp_path)
    monkeypatch.setattr(decoder, "verify_stochastic_table",
                        lambda *a, **kw: verify_stochastic_table(*a, **{**kw, "extra_draws": None}))
    counts, _ = dist.sample_two_tokens(target, draft, dist.SPECS["specexec"], dist.SAMPLES["specexec"], seed=17)
    p = dist.p_values(counts, dist.exact_joint(target, dist.PROMPT + [dist.ROOT]))
    assert min(p.values()) < dist.ALPHA / 2, p


# ---- quantized weights (issue 18) --------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_fused_dequant_kernels_equal_the_cpu_dequantization_on_cuda(qtype):
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from offload_engine.formats import gguf_blocks
    from offload_engine.runtime import triton_dequant
    assert triton_dequant.available(), "Triton is missing from this CUDA install"
    rng = np.random.default_rng(0)
    per, size = gguf_blocks.BLOCK_SIZES[qtype]
    for rows, cols in [(1, per), (3, per * 2), (33, per * 5), (1000, per * 3)]:
        if qtype.endswith("_K"):
            n = rows * cols // per
            raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
            fields = [(208, 210)] if qtype == "Q6_K" else [(0, 2), (2, 4)]
            for lo, hi in fields:
                raw[:, lo:hi] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
        else:
            raw = quants.quantize((rng.standard_normal((rows, cols)) * 2).astype(np.float32), T[qtype])
        data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
        ref = gguf_blocks.dequantize(data, qtype, (rows, cols))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.full((rows, cols), float("nan"), dtype=dtype, device=CUDA)
            assert triton_dequant.dequantize_into(data.to(CUDA), qtype, out)
            assert torch.equal(out.cpu(), ref.to(dtype)), (qtype, rows, cols, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offload,buffers", [("ram", 2), ("disk", 3), ("none", None)])
def test_gguf_target_streamed_equals_resident_on_cuda(tmp_path, monkeypatch, dtype, offload, buffers):
    """A GGUF target of every block format, its blocks streamed and turned into compute-dtype
    weights by the fused kernels on the copy stream: the logits of the float32 conversion run
    resident on the GPU, bit for bit."""
    from test_quantized_weights import _passes, write_mixed_gguf
    from test_gguf import gpt2_tokenizer_meta

    from offload_engine import Engine
    from offload_engine.formats.gguf_import import convert_gguf
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = write_mixed_gguf(tmp_path / "mixed.gguf", gpt2_tokenizer_meta("smollm"))
    f32 = convert_gguf(src, tmp_path / "f32", progress=False)
    reference = Transformer.from_checkpoint(Checkpoint(f32, load_config(f32)), dtype, CUDA)
    expected = _on_cuda(_passes(reference))
    engine = Engine.load(src, device="cuda", dtype=dtype, offload=offload, buffers=buffers, progress=False)
    try:
        got = _on_cuda(_passes(engine.model))
        stats = engine.model.layers.snapshot()
        if offload != "none":
            assert stats.dequant_seconds > 0 and stats.bytes_streamed > 0
    finally:
        engine.close()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_torch_quantizers_on_cuda_make_the_gguf_packages_bytes(qtype):
    """Stores built for a GPU are quantized on it: the same bytes as the package's numpy code
    (divisions by a number are done tensor by tensor, never as a reciprocal's product)."""
    import gguf
    import numpy as np

    from offload_engine.runtime.blocks import quantize
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((512, 1024)) * rng.uniform(1e-3, 10, (512, 1))).astype(np.float32)
    with np.errstate(all="ignore"):
        want = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]).view(np.uint8).reshape(512, -1)
    assert np.array_equal(quantize(torch.from_numpy(w).to(CUDA), qtype).cpu().numpy(), want)
