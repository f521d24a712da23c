"""The layer-streaming executor against the fully resident model: bitwise equal logits (CPU, fp32)."""

import pytest
import torch

from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.layer_store import LayerLayout
from offload_engine.runtime.loader import OffloadOptions, load_target
from offload_engine.runtime.model import Transformer, causal_mask
from offload_engine.runtime.placement import fixed_parts, make_plan
from tiny_models import make_tiny_checkpoint

LAYERS = 4
BATCH = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("stream") / "m", "llama3-gqa", layers=LAYERS,
                                  init_std=0.1)
    return Checkpoint(folder, load_config(folder))


@pytest.fixture(scope="module")
def reference(ckpt):
    return Transformer.from_checkpoint(ckpt, torch.float32)


def random_tree_mask(prefix: int, n: int, seed: int):
    """A random tree of n nodes after `prefix` committed tokens: ancestor mask and depth positions."""
    g = torch.Generator().manual_seed(seed)
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    depth = [0] * n
    mask = torch.zeros(n, prefix + n, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(n):
        j = i
        while j != -1:
            mask[i, prefix + j] = True
            j = parent[j]
        depth[i] = 0 if parent[i] == -1 else depth[parent[i]] + 1
    return mask, torch.tensor(depth) + prefix


def run_script(model, vocab, device=torch.device("cpu")):
    """Prefill, single-token decode, a 64-node tree batch with a custom mask, a commit of two tree
    slots, then a causal chunk after them."""
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(128)
    outs = []
    ids = torch.randint(0, vocab, (20,), generator=g).to(device)
    outs.append(model.forward(ids, torch.arange(20, device=device), cache))
    cache.advance(20)
    outs.append(model.forward(ids[:1], torch.tensor([20], device=device), cache))
    cache.advance(1)
    mask, pos = random_tree_mask(21, BATCH, seed=1)
    tree = torch.randint(0, vocab, (BATCH,), generator=g).to(device)
    outs.append(model.forward(tree, pos.to(device), cache, mask=mask.to(device)))
    cache.commit([21, 21 + 5])  # keep two of the tree's slots
    outs.append(model.forward(ids[2:5], torch.arange(23, 26, device=device), cache,
                              mask=causal_mask(23, 3, device)))
    return outs


def plan_for(ckpt, offload, buffers, resident=0, ram_layers=0, dtype=torch.float32):
    """A plan in `dtype` with exactly `resident` device layers and `ram_layers` RAM layers (rest on disk)."""
    cfg = ckpt.config
    layer = LayerLayout.for_config(cfg, dtype).block_bytes
    fixed = sum(fixed_parts(cfg, dtype, 256, BATCH).values())
    vram = fixed + (buffers + resident) * layer + layer // 2 if offload != "none" else 2**30
    return make_plan(cfg, dtype, offload=offload, vram_bytes=vram, ram_bytes=ram_layers * layer,
                     buffers=buffers, max_context=256, max_batch_tokens=BATCH)


CASES = [("none", 2, 0, 0), ("disk", 1, 0, 0), ("disk", 2, 0, 0), ("disk", 3, 0, 0), ("ram", 1, 0, 4),
         ("ram", 2, 0, 4), ("ram", 3, 0, 4), ("auto", 1, 2, 1), ("auto", 2, 1, 2), ("auto", 3, 0, 2)]


@pytest.mark.parametrize("offload,buffers,resident,ram_layers", CASES)
def test_streamed_logits_bitwise_equal_resident(ckpt, reference, tmp_path, offload, buffers, resident, ram_layers):
    plan = plan_for(ckpt, offload, buffers, resident, ram_layers)
    if offload == "none":
        assert len(plan.resident_layers) == LAYERS and plan.buffers == 0
    else:
        assert len(plan.resident_layers) == resident and plan.buffers == buffers
        assert len(plan.ram_layers) == min(ram_layers, LAYERS - resident)
        assert len(plan.disk_layers) == LAYERS - resident - len(plan.ram_layers)
    model = load_target(ckpt, torch.float32, torch.device("cpu"), plan,
                        OffloadOptions(offload, buffers=buffers, store_root=tmp_path), progress=False)
    try:
        expected = run_script(reference, ckpt.config.vocab_size)
        got = run_script(model, ckpt.config.vocab_size)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        stats = model.layers.snapshot()
        assert stats.target_passes == len(expected)
        # measured, not planned: every streamed block came in once per pass, and the disk-tier
        # ones were read from disk (the loader is already filling buffers for a next pass)
        assert stats.bytes_streamed == len(expected) * plan.bytes_per_pass
        block = LayerLayout.for_config(ckpt.config, torch.float32).block_bytes
        assert stats.bytes_read == len(expected) * len(plan.disk_layers) * block
        assert 0 <= stats.prefetched_bytes <= plan.buffers * block
        if plan.streamed_layers:
            assert stats.copy_seconds > 0
    finally:
        model.layers.close()


def test_abandoned_pass_keeps_the_loader_in_step(ckpt, reference, tmp_path):
    """An exception inside a pass (here: a bad mask) must not desynchronise later passes."""
    plan = plan_for(ckpt, "disk", 2)
    model = load_target(ckpt, torch.float32, torch.device("cpu"), plan,
                        OffloadOptions("disk", store_root=tmp_path), progress=False)
    try:
        with pytest.raises(RuntimeError):
            model.forward(torch.tensor([1, 2]), torch.arange(2), model.new_cache(8),
                          mask=torch.ones(3, 3, dtype=torch.bool))
        expected = run_script(reference, ckpt.config.vocab_size)
        for a, b in zip(run_script(model, ckpt.config.vocab_size), expected):
            assert torch.equal(a, b)
    finally:
        model.layers.close()


def test_a_loader_waiting_for_a_buffer_is_stopped_at_once(ckpt, reference, tmp_path, monkeypatch):
    """Closing, or abandoning a pass, wakes a loader blocked on a full set of buffers: with its
    poll made a minute long, both take well under it, and the passes after the abandoned one
    are still right (the woken loader reads nothing more)."""
    import time

    from offload_engine.runtime import streamer
    monkeypatch.setattr(streamer, "_POLL_S", 60.0)
    plan = plan_for(ckpt, "disk", 2)
    model = load_target(ckpt, torch.float32, torch.device("cpu"), plan,
                        OffloadOptions("disk", store_root=tmp_path), progress=False)
    executor = model.layers
    try:
        deadline = time.perf_counter() + 10
        while executor._filled_ahead < 2 * executor.layout.max_block and time.perf_counter() < deadline:
            time.sleep(0.01)  # both buffers filled: the loader now waits for one to be freed
        assert executor._filled_ahead == 2 * executor.layout.max_block
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError):  # a pass abandoned at its first layer restarts the loader
            model.forward(torch.tensor([1, 2]), torch.arange(2), model.new_cache(8),
                          mask=torch.ones(3, 3, dtype=torch.bool))
        assert time.perf_counter() - t0 < 5.0
        expected = run_script(reference, ckpt.config.vocab_size)
        for a, b in zip(run_script(model, ckpt.config.vocab_size), expected):
            assert torch.equal(a, b)
        time.sleep(0.2)  # (the loader fills ahead for a next pass and blocks again)
        t0 = time.perf_counter()
        executor.close()
        assert time.perf_counter() - t0 < 5.0 and executor._thread is None
    finally:
        executor.close()


def test_measured_bytes_see_a_reader_that_skips_a_block(ckpt, tmp_path):
    """The byte counts come from the reads themselves: a reader that skips one block (returns
    without reading it) shows as fewer bytes than the plan, not as the plan's constant."""
    plan = plan_for(ckpt, "disk", 2)
    model = load_target(ckpt, torch.float32, torch.device("cpu"), plan,
                        OffloadOptions("disk", store_root=tmp_path), progress=False)
    executor = model.layers
    real_read, skipped = executor.reader.read, plan.disk_layers[1]
    executor._stop_loader()
    executor.reader.read = lambda layer, out: 0 if layer == skipped else real_read(layer, out)
    executor._start_loader()
    try:
        model.forward(torch.tensor([1, 2]), torch.arange(2), model.new_cache(8))
        stats = executor.snapshot()
        block = LayerLayout.for_config(ckpt.config, torch.float32).block_bytes
        assert stats.target_passes == 1
        assert stats.bytes_read == stats.bytes_streamed == plan.bytes_per_pass - block
    finally:
        executor.close()


def test_overlapping_passes_are_refused_not_deadlocked(ckpt, tmp_path):
    plan = plan_for(ckpt, "disk", 2)
    model = load_target(ckpt, torch.float32, torch.device("cpu"), plan,
                        OffloadOptions("disk", store_root=tmp_path), progress=False)
    try:
        first = iter(model.layers)
        next(first)
        with pytest.raises(RuntimeError, match="already running"):
            model.forward(torch.tensor([1]), torch.tensor([0]), model.new_cache(4))
        first.close()  # drains the abandoned pass
        expected = run_script(Transformer.from_checkpoint(ckpt, torch.float32), ckpt.config.vocab_size)
        for a, b in zip(run_script(model, ckpt.config.vocab_size), expected):
            assert torch.equal(a, b)
    finally:
        model.layers.close()


def test_engine_stops_its_loader_when_collected(ckpt, tmp_path, monkeypatch):
    import gc
    import threading

    from offload_engine import Engine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engine = Engine.load(ckpt.folder, offload="disk", progress=False)
    assert any(t.name == "layer-loader" for t in threading.enumerate())
    del engine
    gc.collect()
    assert not any(t.name == "layer-loader" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("offload,weights", [("ram", "auto"), ("disk", "bf16")])
def test_the_loader_thread_never_starts_an_openmp_team(tmp_path, monkeypatch, offload, weights):
    """The loader thread moves bytes (a memcpy, an O_DIRECT read, the compiled loop's POSIX
    threads, which also widen a layer stored in bf16), never a parallel torch op: one would leave
    OpenMP a thread team of the loader's own beside the compute thread's, and while it lives
    torch's workers stop spinning between parallel regions (measured on a 2-vCPU machine: every
    small matmul 2-4x slower). A team shows as an OS thread that is neither a Python thread nor
    one the process had before the engine. Two torch threads, so that a team can form; the
    loader's fills for the first pass are done before any pass runs."""
    import os
    import threading
    import time

    from offload_engine.engine import Engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = make_tiny_checkpoint(tmp_path / "m", "llama3-gqa", layers=3, hidden=256, intermediate=512)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 20).add_(1)  # the compute thread's own team exists before the baseline
        before = set(os.listdir("/proc/self/task"))
        engine = Engine.load(folder, device="cpu", offload=offload, weights=weights, buffers=2, progress=False)
        try:
            executor = engine.model.layers
            assert 256 * 256 > 32768  # torch runs a copy or conversion over this many elements in parallel
            assert any(s.fmt == "BF16" for s in executor.layout.packed_slots(executor.order)) == (weights == "bf16")
            deadline = time.monotonic() + 30
            while executor.snapshot().prefetched_bytes < 2 * min(executor.layout.sizes) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert executor.snapshot().prefetched_bytes > 0
            engine.generate("hello there", max_new_tokens=4, temperature=0.0)

            def others() -> set[str]:
                python_threads = {str(t.native_id) for t in threading.enumerate()}
                return set(os.listdir("/proc/self/task")) - before - python_threads

            # a team's worker stays for the loader's life; the compiled loop's own threads end with
            # each call, and the loader goes on filling the next pass's buffers for a moment
            deadline = time.monotonic() + 5
            while others() and time.monotonic() < deadline:
                time.sleep(0.02)
            extra = others()

            def name(tid: str) -> str:  # (a failure names each thread it found)
                try:
                    with open(f"/proc/self/task/{tid}/comm") as comm:
                        return comm.read().strip()
                except OSError:
                    return "gone"
            assert extra == set(), {tid: name(tid) for tid in extra}
        finally:
            engine.close()
    finally:
        torch.set_num_threads(threads)
