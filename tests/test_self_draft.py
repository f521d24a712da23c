"""The self-draft (`--draft self-int8` / `self-int4`): quantisation within its documented bounds,
the packed kernels against the dequantised reference, logits close to the target's, greedy
speculation exactly plain greedy, and its bytes in the placement plan."""

import time

import pytest
import torch

from offload_engine import UserError
from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.kv_cache import KVCache
from offload_engine.runtime.model import Transformer
from offload_engine.speculation.drafts import build_self_draft, head_bytes, self_draft_bytes
from offload_engine.runtime import quant
from offload_engine.runtime.quant import (
    QuantizedLinear, WIDE_ROWS, pack_nibbles, unpack_nibbles, error_bound, quantize_int4, quantize_int8, quantized_bytes,
)
from tiny_models import greedy_past_eos, make_tiny_checkpoint

PROMPT = "The capital of France is"


def _weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    w[3, 17] = 40.0  # an outlier: its row (int8) and group (int4) get a coarse grid, others do not
    w[5] *= 1e-4  # a nearly-zero row
    return w


def test_int8_error_within_bound():
    w = _weights()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (q.float() * scale[:, None] - w).abs()
    # the bound |w - q s| <= s/2 = max|row|/254, up to float32 rounding of the product
    assert bool((err <= error_bound(w, "int8") * (1 + 1e-5) + 1e-7).all())
    assert float((err / error_bound(w, "int8")).max()) > 0.5  # the bound is tight, not vacuous


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_within_bound(group):
    w = _weights()
    q, scale, lo = quantize_int4(w, group)
    assert int(q.max()) <= 15
    deq = (q.float().reshape(96, -1, group) * scale[..., None] + lo[..., None]).reshape(96, 256)
    err = (deq - w).abs()
    assert bool((err <= error_bound(w, "int4", group) * (1 + 1e-5) + 1e-7).all())
    assert float((err / error_bound(w, "int4", group)).max()) > 0.5
    ql = QuantizedLinear.from_weight(w, "int4", group, backend="dequant")
    assert torch.equal(ql.dequantize(), deq)  # the stored nibbles dequantise to the same matrix


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (8, 32), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_packed_kernel_matches_the_dequantised_matmul(scheme, monkeypatch):
    """torch 2.13's CPU build has both packed kernels: they must be chosen, and agree with the
    dense matmul of the dequantised matrix to bfloat16 precision (2e-2 of the output's scale)."""
    monkeypatch.setattr(quant, "_wide_pays", lambda ql: True)  # (whether it pays: the test below)
    w = _weights()
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    kernel = QuantizedLinear.from_weight(w, scheme, 64, backend="kernel")
    dequant = QuantizedLinear.from_weight(w, scheme, 64, backend="dequant")
    assert kernel.backend == "kernel" and dequant.backend == "dequant"
    want = x @ dequant.dequantize().T
    got = kernel.linear(x)
    assert got.dtype == torch.float32 and got.shape == (7, 96)
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())
    assert kernel.nbytes() == quantized_bytes(96, 256, scheme, 64)  # what the plan counts
    # int8 on the CPU: WIDE_ROWS rows or more take the integer GEMM (fewer, the packed kernel above),
    # activations quantised per row: each output is off by at most the activations' rounding,
    # max|x_row| / 254, times the row's sum of |weights| (the int32 sums are exact)
    assert kernel.wide == (scheme == "int8")  # (the GEMM pays, as _wide_pays is set here: the path's arithmetic)
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    kernel.linear(torch.randn(WIDE_ROWS - 1, 256))
    w_abs = dequant.dequantize().abs().sum(1)
    for shape in ((WIDE_ROWS, 256), (2, 12, 256)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
        want = x @ dequant.dequantize().T
        got = kernel.linear(x)
        assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 96)
        if scheme == "int8":  # (int4 has no such path: the packed kernel, checked above)
            bound = x.abs().amax(-1, keepdim=True) / 254 * w_abs + 1e-5 * want.abs().max()
            assert bool(((got - want).abs() <= bound).all())
            # and it is that rounding, as documented: s_x = max|x_row| / 127, q_x = round(x / s_x)
            # (the weights: the int8 codes times the kernel's bfloat16 row scales)
            sx = x.double().abs().amax(-1, keepdim=True) / 127
            exact = (torch.round(x.double() / sx) * sx) @ (kernel.data.double() * kernel.scale.double()[:, None]).T
            assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    assert calls == ([WIDE_ROWS, 24] if scheme == "int8" else [])


@pytest.mark.parametrize("slow", ["gemm", "packed"])
def test_the_integer_gemm_is_taken_only_where_it_is_timed_faster(slow, monkeypatch):
    """The CPU's integer GEMM is fast only with VNNI (15x slower than the packed kernel on an
    AVX2-only host, 2026-12-03): `_wide_pays` times both, once per matrix shape. Each path slowed
    by 20 ms a call here in turn: the other one is chosen, and the choice is kept for the shape."""
    monkeypatch.setattr(quant, "_WIDE_PAYS", {})
    name = "_int_mm" if slow == "gemm" else "_weight_int8pack_mm"
    real = getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a: time.sleep(0.02) or real(*a))
    kernel = QuantizedLinear.from_weight(_weights(), "int8", backend="kernel")
    assert kernel.backend == "kernel" and kernel.wide == (slow == "packed")
    assert quant._WIDE_PAYS == {(96, 256): slow == "packed"}
    monkeypatch.setattr(torch, name, real)  # timed once per shape: a second matrix of it keeps the choice
    assert QuantizedLinear.from_weight(_weights(), "int8", backend="kernel").wide == (slow == "packed")


def test_group_size_must_divide_inputs():
    with pytest.raises(ValueError, match="does not divide"):
        QuantizedLinear.from_weight(torch.randn(8, 96), "int4", 64)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("selfdraft") / "t", "llama3-gqa", layers=3, seed=3,
                                init_std=0.05)


# Relative L2 error of the self-draft's logits against the target's, over a 24-token prompt of
# a tiny random model (init std 0.05, int4 groups of 32). Measured over 3 prompts, both backends:
# int8 0.013-0.022, int4 0.18-0.26 (a random model has no outlier structure to hide the grid in).
# Thresholds about 2x the worst.
LOGIT_TOLERANCE = {"int8": 0.05, "int4": 0.5}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("backend", ["kernel", "dequant"])
def test_self_draft_logits_close_to_the_target(target, scheme, backend):
    cfg = load_config(target)
    ckpt = Checkpoint(target, cfg)
    model = Transformer.from_checkpoint(ckpt, torch.float32)
    draft = build_self_draft(ckpt, model, scheme, 32, backend)
    ckpt.close()
    assert draft.embed is model.embed and draft.lm_head is model.lm_head  # shared, not copied
    ids = torch.randint(3, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)
    want = model.forward(ids, pos, model.new_cache(24))
    got = draft.forward(ids, pos, draft.new_cache(24))
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < LOGIT_TOLERANCE[scheme]


@pytest.mark.parametrize("draft", ["self-int8", "self-int4"])
@pytest.mark.parametrize("offload", ["none", "disk"])
def test_greedy_with_self_draft_equals_plain_greedy(target, tmp_path, monkeypatch, draft, offload):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = greedy_past_eos(target, PROMPT, 40)[0].token_ids
    result, engine = greedy_past_eos(target, PROMPT, 40, tree="sequoia", draft=draft, draft_group_size=32, offload=offload,
                                     tree_budget=24, tree_depth=6)
    assert result.token_ids == want
    assert result.stats["tokens_per_step"] > 1.5  # a close copy of the target: most levels accepted
    # the plan's count is what the built draft holds (every weight took the kernel layout)
    held = sum(w.nbytes() if isinstance(w, QuantizedLinear) else w.numel() * w.element_size()
               for layer in engine.draft.layers for w in layer.values())
    assert all(w.backend == "kernel" for layer in engine.draft.layers for w in layer.values()
               if isinstance(w, QuantizedLinear))
    head = engine.draft.quantized_head  # (on the CPU: an int8 copy of the head, counted by the plan too)
    assert isinstance(head, QuantizedLinear) and head.scheme == "int8" and head.backend == "kernel"
    assert engine.plan.fixed_bytes["draft"] == held + head.nbytes()


def test_self_draft_bytes_in_the_plan_and_bad_group_refused(target):
    from offload_engine.engine import plan_only
    plan8, *_ = plan_only(target, device="cpu", draft="self-int8", offload="disk")
    plan4, *_ = plan_only(target, device="cpu", draft="self-int4", draft_group_size=32, offload="disk")
    cfg = load_config(target)
    from offload_engine.formats.checkpoint import layer_shapes
    fp32_layers = 3 * 4 * sum(torch.Size(s).numel() for s in layer_shapes(cfg).values())
    head = head_bytes(cfg, "cpu")  # (an int8 copy of the head on the CPU: the vocabulary's rows, a scale each)
    assert head == cfg.vocab_size * (cfg.hidden_size + 2)
    assert plan8.fixed_bytes["draft"] == self_draft_bytes(cfg, torch.float32, "int8", 32) + head
    assert 0.25 < (plan8.fixed_bytes["draft"] - head) / fp32_layers < 0.30  # 1 byte per weight, scales and norms
    assert plan4.fixed_bytes["draft"] < plan8.fixed_bytes["draft"]  # 4 bits per weight plus group scales
    assert head_bytes(cfg, "cuda") == 0
    with pytest.raises(UserError, match="--draft-group-size 48 does not divide the 64 inputs"):
        plan_only(target, device="cpu", draft="self-int4", draft_group_size=48)
    with pytest.raises(UserError, match="not a checkpoint folder"):
        plan_only(target, device="cpu", draft="self-int3")


@pytest.mark.parametrize("scheme,gemm", [("int8", False), ("int8", True), ("int4", False)])
def test_fused_projections_give_the_separate_outputs_bit_for_bit(target, scheme, gemm, monkeypatch):
    """`model.fuse_projections`: a self-draft layer's q/k/v and gate/up matrices stacked into one
    each give the separate matrices' outputs bit for bit (rows are quantised independently), rope
    applied to q and k at once included; widths 1, 5 and 12 over a cached 9-token prefix. Whether
    int8 inputs of WIDE_ROWS rows or more take the integer GEMM is timed per matrix shape
    (`quant._wide_pays`), so a fused and a separate matrix can differ in it under load: it is
    fixed here, each way (the GEMM where this CPU has it and it agrees with the reference)."""
    from offload_engine.runtime import model as M
    from offload_engine.runtime import quant
    monkeypatch.setattr(quant, "_wide_pays", lambda ql: gemm)
    cfg = load_config(target)
    ckpt = Checkpoint(target, cfg)
    full = ckpt.load_layer(1, torch.float32, "cpu")
    ckpt.close()

    def make(w):
        return QuantizedLinear.from_weight(w, scheme, 32)
    separate = {n: make(w) if n.endswith("proj.weight") else w for n, w in full.items()}
    fused = M.fuse_projections(full, make)
    assert M.FUSED_QKV in fused and M.FUSED_GATE_UP in fused and "self_attn.q_proj.weight" not in fused
    assert "mlp.up_proj.weight" not in fused and "mlp.down_proj.weight" in fused
    fused = {n: make(w) if n.endswith("proj.weight") and isinstance(w, torch.Tensor) else w for n, w in fused.items()}
    int8 = [m for layer in (separate, fused) for m in layer.values() if isinstance(m, QuantizedLinear)
            and m.scheme == "int8" and m.backend == "kernel"]
    if gemm and not any(m.wide for m in int8):
        pytest.skip("this CPU's integer GEMM is missing or disagrees with the reference: no int8 matrix takes it")
    assert all(m.wide == gemm for m in int8)  # (each matrix takes the path the case is for)
    inv = M.rope_inv_freq(cfg)
    g = torch.Generator().manual_seed(5)
    for width in (1, 5, 12):
        outs = []
        for layer in (separate, fused):
            cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32, "cpu")
            g.manual_seed(width)
            prefix = torch.randn(1, 9, cfg.hidden_size, generator=g)
            M.decoder_layer(layer, prefix, M.Rope.at(inv, torch.arange(9), torch.float32), cache, 0,
                            M.causal_mask(0, 9), cfg)
            cache.advance(9)
            x = torch.randn(1, width, cfg.hidden_size, generator=g)
            pos = torch.arange(9, 9 + width)
            outs.append(M.decoder_layer(layer, x, M.Rope.at(inv, pos, torch.float32), cache, 0,
                                        M.causal_mask(9, width), cfg))
        assert torch.equal(outs[0], outs[1]), (width, float((outs[0] - outs[1]).abs().max()))


# The int8 head's logits against the float head's, relative L2 over a 24-token prompt of the tiny
# model: measured 0.0067-0.0070 over three seeds (int8 per-row scales: |w - q s| <= max|row| / 254);
# threshold 0.02.
HEAD_TOLERANCE = 0.02


def test_a_cpu_self_draft_computes_its_logits_from_an_int8_head(target):
    cfg = load_config(target)
    ckpt = Checkpoint(target, cfg)
    model = Transformer.from_checkpoint(ckpt, torch.float32)
    draft = build_self_draft(ckpt, model, "int8", 32)
    ckpt.close()
    head = draft.quantized_head
    assert isinstance(head, QuantizedLinear) and (head.out_features, head.in_features) == (cfg.vocab_size,
                                                                                            cfg.hidden_size)
    assert model.quantized_head is None  # (the target's own logits stay float)
    ids = torch.randint(3, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    got = draft.forward(ids, torch.arange(24), draft.new_cache(24))
    draft.quantized_head = None
    want = draft.forward(ids, torch.arange(24), draft.new_cache(24))
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < HEAD_TOLERANCE, rel
