"""The packed layer store: layout, contents, and never trusting a half-built or stale store."""

import json
import os
import shutil
import time

import pytest
import torch

from offload_engine import Engine
from offload_engine.errors import UserError
from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.layer_store import BLOCK_ALIGN, aligned_buffer, open_or_build
from tiny_models import make_tiny_checkpoint


@pytest.fixture()
def folder(tmp_path):
    return make_tiny_checkpoint(tmp_path / "m", "qwen2", layers=3)


def _ckpt(folder):
    return Checkpoint(folder, load_config(folder))


def _dirs(root):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_store_blocks_hold_exactly_the_checkpoint_tensors(folder, tmp_path):
    ckpt = _ckpt(folder)
    store = open_or_build(ckpt, torch.bfloat16, tmp_path / "stores", progress=False)
    assert store.path.stat().st_size == sum(store.layout.sizes) == 3 * store.layout.max_block
    assert all(size % BLOCK_ALIGN == 0 for size in store.layout.sizes)
    reader = store.reader(direct=True)
    buf = aligned_buffer(store.layout.max_block)
    for i in range(3):
        reader.read(i, buf)  # O_DIRECT (or its stated fallback) read of one block
        views = store.layout.layouts[i].views(buf)
        assert set(views) == set(ckpt.load_layer(i, torch.bfloat16))
        for name, expected in ckpt.load_layer(i, torch.bfloat16).items():
            assert torch.equal(views[name], expected), (i, name)
    reader.close()


def test_store_is_reused_and_rebuilt_when_checkpoint_or_dtype_changes(folder, tmp_path):
    root = tmp_path / "stores"
    a = open_or_build(_ckpt(folder), torch.float32, root, progress=False)
    stamp = a.path.stat().st_mtime_ns
    assert open_or_build(_ckpt(folder), torch.float32, root, progress=False).path.stat().st_mtime_ns == stamp
    b = open_or_build(_ckpt(folder), torch.float16, root, progress=False)
    assert b.folder != a.folder
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # the checkpoint changed
    c = open_or_build(_ckpt(folder), torch.float32, root, progress=False)
    assert c.folder != a.folder


def test_build_from_a_truncated_checkpoint_leaves_nothing(folder, tmp_path):
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * 0.9)])
    root = tmp_path / "stores"
    with pytest.raises(UserError, match="model.safetensors"):
        open_or_build(Checkpoint(folder, load_config(folder)), torch.float32, root, progress=False)
    assert _dirs(root) == []


def test_interrupted_build_leaves_nothing_a_later_run_trusts(folder, tmp_path, monkeypatch):
    root = tmp_path / "stores"
    real = Checkpoint.load

    def dies_at_layer_2(self, name, *a, **k):
        if name.startswith("model.layers.2."):
            raise KeyboardInterrupt
        return real(self, name, *a, **k)

    monkeypatch.setattr(Checkpoint, "load", dies_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        open_or_build(_ckpt(folder), torch.float32, root, progress=False)
    assert _dirs(root) == []
    monkeypatch.setattr(Checkpoint, "load", real)
    store = open_or_build(_ckpt(folder), torch.float32, root, progress=False)
    assert store.path.stat().st_size == store.layout.total_bytes


def test_a_killed_build_is_never_trusted(folder, tmp_path):
    """What a process killed mid-build (kill -9) can leave: a temp folder, or, had it been renamed
    early, a store whose file is short. Neither is used; the stale temp folder is swept away."""
    root = tmp_path / "stores"
    good = open_or_build(_ckpt(folder), torch.float32, root, progress=False)
    reference = good.path.read_bytes()
    # a short layers.bin under the real name, and an old temp folder of a dead process
    good.path.write_bytes(reference[: len(reference) // 2])
    stale = root / f".{good.folder.name}.tmp-dead"
    stale.mkdir()
    (stale / "layers.bin").write_bytes(b"x" * 100)
    old = time.time() - 7200
    os.utime(stale, (old, old))
    fresh = root / f".{good.folder.name}.tmp-alive"  # another process building right now
    fresh.mkdir()
    rebuilt = open_or_build(_ckpt(folder), torch.float32, root, progress=False)
    assert rebuilt.path.read_bytes() == reference
    assert not stale.exists() and fresh.exists()
    # a layout.json that disagrees with the model is not trusted either
    meta = json.loads((rebuilt.folder / "layout.json").read_text())
    meta["layout"]["layouts"][0]["block_bytes"] += 4096
    (rebuilt.folder / "layout.json").write_text(json.dumps(meta))
    again = open_or_build(_ckpt(folder), torch.float32, root, progress=False)
    assert again.path.read_bytes() == reference
    shutil.rmtree(fresh)


@pytest.mark.parametrize("offload", ["disk", "ram"])
def test_engine_streamed_greedy_equals_resident_and_reports_stats(folder, offload, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the store is built there
    resident = Engine.load(folder, offload="none", progress=False)
    streamed = Engine.load(folder, offload=offload, buffers=2, progress=False)
    try:
        a = resident.generate("The capital of France is", max_new_tokens=12)
        b = streamed.generate("The capital of France is", max_new_tokens=12)
        assert a.token_ids == b.token_ids
        s = b.stats
        assert s["target_passes"] == len(b.token_ids)  # one prefill pass, then one per new token but the last
        assert s["bytes_streamed"] == s["target_passes"] * streamed.plan.bytes_per_pass > 0
        for key in ("copy_seconds", "compute_seconds", "stall_seconds", "effective_gbps"):
            assert s[key] > 0, key
        assert a.stats["bytes_streamed"] == 0 and a.stats["target_passes"] == len(a.token_ids)
        assert any((tmp_path / "cache" / "sequoia-offload" / "stores").iterdir())
    finally:
        streamed.close()
        resident.close()
