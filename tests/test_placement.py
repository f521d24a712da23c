"""The placement planner: exact byte arithmetic, tiers, boundaries and refusals."""

import dataclasses

import pytest
import torch

from offload_engine.apps.cli import main
from offload_engine.errors import UserError
from offload_engine.formats.config import load_config
from offload_engine.runtime.layer_store import BLOCK_ALIGN, LayerLayout
from offload_engine.runtime.placement import fixed_parts, make_plan, parse_size
from tiny_models import make_tiny_checkpoint

CTX, BATCH = 256, 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plan") / "m", "llama3-gqa", layers=6)


@pytest.fixture(scope="module")
def cfg(folder):
    return load_config(folder)


def _sizes(cfg, dtype=torch.float32, draft=0):
    layer = LayerLayout.for_config(cfg, dtype).block_bytes
    return layer, sum(fixed_parts(cfg, dtype, CTX, BATCH, draft).values())


def _plan(cfg, **kw):
    args = dict(offload="auto", buffers=2, max_context=CTX, max_batch_tokens=BATCH, ram_bytes=0)
    args.update(kw)
    return make_plan(cfg, torch.float32, **args)


def test_everything_fits_exactly_at_the_boundary(cfg):
    layer, fixed = _sizes(cfg)
    plan = _plan(cfg, vram_bytes=fixed + 6 * layer)
    assert plan.resident_layers == tuple(range(6)) and plan.buffers == 0 and plan.bytes_per_pass == 0
    assert plan.vram_bytes == fixed + 6 * layer


def test_one_byte_less_streams_with_buffers(cfg):
    layer, fixed = _sizes(cfg)
    plan = _plan(cfg, vram_bytes=fixed + 6 * layer - 1, ram_bytes=2 * layer)
    # buffers (2 layers) come first, then floor((budget - fixed - 2 layers) / layer) = 3 resident layers
    assert plan.buffers == 2 and plan.resident_layers == (0, 1, 2)
    assert plan.ram_layers == (3, 4) and plan.disk_layers == (5,)
    assert plan.bytes_per_pass == 3 * layer
    assert plan.vram_bytes <= plan.vram_budget_bytes


def test_ram_budget_exactly_at_a_layer_boundary(cfg):
    layer, fixed = _sizes(cfg)
    for ram, expected in [(3 * layer, 3), (3 * layer - 1, 2), (100 * layer, 6)]:
        plan = _plan(cfg, vram_bytes=fixed + 2 * layer, ram_bytes=ram)
        assert len(plan.ram_layers) == expected and len(plan.disk_layers) == 6 - expected


def test_too_small_for_the_resident_parts(cfg):
    layer, fixed = _sizes(cfg)
    with pytest.raises(UserError, match="too small for the resident parts") as e:
        _plan(cfg, vram_bytes=fixed + 2 * layer - 1)
    for part in ("embeddings", "kv cache", "workspace", "layer buffers"):
        assert part in str(e.value)


def test_a_draft_too_big(cfg):
    layer, fixed = _sizes(cfg)
    draft = 10 * layer
    with pytest.raises(UserError, match="draft"):
        make_plan(cfg, torch.float32, vram_bytes=fixed + 4 * layer, ram_bytes=0, max_context=CTX,
                  max_batch_tokens=BATCH, draft_bytes=draft)
    plan = make_plan(cfg, torch.float32, vram_bytes=fixed + draft + 3 * layer, ram_bytes=10**9,
                     max_context=CTX, max_batch_tokens=BATCH, draft_bytes=draft)
    assert plan.fixed_bytes["draft"] == draft and len(plan.resident_layers) == 1


def test_forced_modes(cfg):
    layer, fixed = _sizes(cfg)
    big = 10**12
    assert _plan(cfg, offload="none", vram_bytes=big).resident_layers == tuple(range(6))
    disk = _plan(cfg, offload="disk", vram_bytes=big, ram_bytes=big)
    assert disk.disk_layers == tuple(range(6)) and not disk.resident_layers and not disk.ram_layers
    ram = _plan(cfg, offload="ram", vram_bytes=big, ram_bytes=big)
    assert ram.ram_layers == tuple(range(6)) and not ram.disk_layers
    with pytest.raises(UserError, match="--offload none"):
        _plan(cfg, offload="none", vram_bytes=fixed + 5 * layer)
    with pytest.raises(UserError, match="--offload ram"):
        _plan(cfg, offload="ram", vram_bytes=big, ram_bytes=5 * layer)
    with pytest.raises(UserError, match="--buffers"):
        _plan(cfg, offload="disk", vram_bytes=big, buffers=0)


def test_odd_layer_sizes_round_to_whole_aligned_blocks(cfg):
    odd = dataclasses.replace(cfg, hidden_size=72, num_heads=3, num_kv_heads=1, head_dim=24,
                              intermediate_size=100)
    layout = LayerLayout.for_config(odd, torch.bfloat16)
    assert layout.block_bytes % BLOCK_ALIGN == 0
    raw = sum(2 * __import__("math").prod(s.shape) for s in layout.slots)
    assert raw <= layout.block_bytes < raw + BLOCK_ALIGN + 256 * len(layout.slots)
    assert all(s.offset % 256 == 0 for s in layout.slots)
    ends = [s.offset + 2 * __import__("math").prod(s.shape) for s in layout.slots]
    assert all(e <= n.offset for e, n in zip(ends, layout.slots[1:]))  # no overlap
    plan = make_plan(odd, torch.bfloat16, offload="disk", vram_bytes=10**9, ram_bytes=0, max_context=CTX,
                     max_batch_tokens=BATCH)
    assert plan.bytes_per_pass == odd.num_layers * layout.block_bytes


@pytest.mark.parametrize("text,expected", [("20GiB", 20 * 2**30), ("512MB", 512 * 10**6), ("1.5g", 1.5e9),
                                           ("4096", 4096), (" 3 KiB ", 3072)])
def test_parse_size(text, expected):
    assert parse_size(text) == int(expected)


@pytest.mark.parametrize("text", ["", "lots", "20 GiBs", "-1GB", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(UserError, match="size"):
        parse_size(text)


def test_plan_command_prints_the_table(folder, capsys):
    cfg = load_config(folder)
    layer = LayerLayout.for_config(cfg, torch.float32).block_bytes
    fixed = sum(fixed_parts(cfg, torch.float32, CTX, 1024).values())  # the engine's widest batch: 1024
    assert main(["plan", "--target", str(folder), "--device", "cpu", "--max-context", str(CTX),
                 "--vram", str(fixed + 3 * layer), "--ram", str(2 * layer), "--buffers", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("| device (resident) | 1 |", "| RAM (pinned with CUDA) | 2 |", "| disk (O_DIRECT) | 3 |"):
        assert row in out
    assert "5 of 6 layers streamed per pass" in out


def test_plan_command_refusal_is_one_line(folder, capsys):
    capsys.readouterr()
    assert main(["plan", "--target", str(folder), "--device", "cpu", "--vram", "1KiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "too small for the resident parts" in err[0]


def test_plan_command_counts_a_draft(folder, tmp_path, capsys):
    from offload_engine.runtime.placement import model_bytes
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama3-gqa", layers=1, hidden=32, heads=2, intermediate=64)
    expected = model_bytes(load_config(draft), torch.float32)
    from safetensors import safe_open
    with safe_open(str(draft / "model.safetensors"), "pt") as f:  # fp32 on disk: the file's tensors
        assert expected == sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    capsys.readouterr()
    assert main(["plan", "--target", str(folder), "--device", "cpu", "--draft", str(draft), "--vram", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "| draft |" in out
    assert main(["plan", "--target", str(folder), "--device", "cpu", "--draft", str(draft),
                 "--vram", str(expected)]) == 2
    assert "draft" in capsys.readouterr().err


def test_cache_slots_and_the_drafts_kv_cache_are_reserved(folder, cfg):
    """Every KV cache prefix reuse keeps (per slot, for the target and for the draft) is in the
    plan, counted by hand: 2 (K and V) x layers x KV heads x head dim x tokens x 4 bytes."""
    from offload_engine.engine import plan_only
    hand = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (CTX + 1024) * 4
    one = plan_only(folder, device="cpu", max_context=CTX)[0].fixed_bytes
    two = plan_only(folder, device="cpu", max_context=CTX, cache_slots=2)[0].fixed_bytes
    assert one["kv cache"] == hand and two["kv cache (2 slots)"] == 2 * hand
    d1 = plan_only(folder, device="cpu", max_context=CTX, draft=folder)[0].fixed_bytes
    d2 = plan_only(folder, device="cpu", max_context=CTX, draft=folder, cache_slots=2)[0].fixed_bytes
    # the draft (here the same shape as the target) has one cache per slot too, beside its weights
    assert d1["draft kv cache"] == hand and d2["draft kv cache (2 slots)"] == 2 * hand
    assert d1["draft"] == d2["draft"] > 0
    with pytest.raises(UserError, match="--cache-slots must be at least 1"):
        plan_only(folder, device="cpu", max_context=CTX, cache_slots=0)
