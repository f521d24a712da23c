"""A hostile disk (issue 22, item 4): a store build on a disk that fills up, and a store that reads
back damaged (a flipped byte, a truncated file, an I/O error, a short read).

Every case ends in one UserError naming the folder or file, the layer and what was wrong, leaves
no partial store, and never lets a layer compute on bytes that are not the ones written. With
HOSTILE_REPORT_DIR set, the figures go to disk.json (docs/hostile.md).
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from offload_engine import Engine
from offload_engine.errors import UserError
from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime import layer_store
from offload_engine.runtime.block_reader import BlockReader, chunk_checksums
from offload_engine.runtime.layer_store import aligned_buffer, open_or_build
from hostile_report import write_report
from tiny_models import make_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
CAUGHT: dict[str, int] = {}  # damage caught, by kind, for disk.json


def report(figures: dict) -> None:
    write_report("disk", figures)


@pytest.fixture(scope="module", autouse=True)
def _report_caught():
    yield
    report({"caught_by_kind": dict(sorted(CAUGHT.items()))})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("integrity") / "m", "qwen2", layers=3)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, where Engine.load builds its store."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "sequoia-offload" / "stores"


def _build(folder, root):
    return open_or_build(Checkpoint(folder, load_config(folder)), torch.float32, root, progress=False)


def _entries(root):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _store_of(cache):
    (folder,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return folder, json.loads((folder / "layout.json").read_text())


def _block_offset(meta, layer):
    """Where block `layer` starts in layers.bin, from layout.json."""
    sizes = [meta["layout"]["layouts"][k]["block_bytes"] for k in meta["layout"]["layer_layout"]]
    return sum(sizes[:layer])


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def _caught(kind, err, *needles):
    for needle in needles:
        assert needle in str(err), (needle, str(err))
    assert "\n" not in str(err)
    CAUGHT[kind] = CAUGHT.get(kind, 0) + 1


def _load(folder, offload="disk", **kw):
    return Engine.load(folder, device="cpu", offload=offload, buffers=2, progress=False, **kw)


# ---- a disk that fills up ---------------------------------------------------------------------

def test_a_disk_without_room_is_refused_before_writing(folder, tmp_path, monkeypatch):
    root = tmp_path / "stores"
    real = os.statvfs

    def nearly_full(path):  # 300 KiB free, whatever the real disk holds
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 75, 75) + tuple(st)[5:])

    monkeypatch.setattr(os, "statvfs", nearly_full)
    with pytest.raises(UserError) as e:
        _build(folder, root)
    layout = layer_store.store_layout(Checkpoint(folder, load_config(folder)), torch.float32)
    needed = layer_store.bytes_needed(layout)
    _caught("full_disk_before_build", e.value, str(root), f"needs {needed} bytes", f"{75 * 4096} bytes")
    assert "filled up" not in str(e.value)
    assert _entries(root) == []
    report({"full_disk_refused_before_writing": {"needed_bytes": needed, "free_bytes": 75 * 4096,
                                                         "message": str(e.value)}})


def _failing_writes(monkeypatch, code, after_bytes):
    """os.write to a layers.bin raises `code` once `after_bytes` of it are written (a disk another
    process filled during the build); other files write as usual."""
    real, written = os.write, [0]

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("layers.bin"):
            if written[0] >= after_bytes:
                raise OSError(code, os.strerror(code))
            written[0] += len(data)
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_disk_filling_up_during_the_build_leaves_nothing(folder, tmp_path, monkeypatch, code):
    root = tmp_path / "stores"
    _failing_writes(monkeypatch, code, after_bytes=1)  # the first block lands, the second fails
    with pytest.raises(UserError) as e:
        _build(folder, root)
    _caught(f"full_disk_during_build_{errno.errorcode[code]}", e.value, str(root), "filled up", "MiB) are free")
    assert _entries(root) == []  # neither the temporary folder nor the target
    monkeypatch.undo()
    store = _build(folder, root)  # room again: the next build completes and is used
    assert store.path.stat().st_size == store.layout.total_bytes
    report({f"full_disk_during_build_{errno.errorcode[code]}": str(e.value)})


@pytest.fixture()
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (skipped, with the reason, where mounting is not permitted)."""
    where = tmp_path / "small"
    where.mkdir()
    try:
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                             capture_output=True, text=True)
        refused = (" ".join(run.stderr.split()) or run.returncode) if run.returncode else None
    except FileNotFoundError:
        refused = "no mount command"
    if refused is not None:
        pytest.skip(f"cannot mount a tmpfs here ({refused}); the injected-ENOSPC tests above cover the same paths")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_real_small_tmpfs_that_fills_up(folder, small_tmpfs, monkeypatch):
    root = small_tmpfs / "stores"
    filler = small_tmpfs / "other-process"
    layout = layer_store.store_layout(Checkpoint(folder, load_config(folder)), torch.float32)
    free = layer_store.free_bytes(small_tmpfs)
    assert layer_store.bytes_needed(layout) < free  # the store fits the empty tmpfs
    # 1. too little room from the start: refused with the real free space, nothing written
    filler.write_bytes(b"x" * (free - layout.total_bytes // 2))
    with pytest.raises(UserError) as before:
        _build(folder, root)
    _caught("full_tmpfs_before_build", before.value, str(root), "needs", f"{layer_store.free_bytes(root)} bytes")
    assert "filled up" not in str(before.value)  # refused by the free-space check, before any write
    assert _entries(root) == []
    # 2. room at the start, then another process fills the disk during the build: the kernel's ENOSPC
    filler.unlink()
    real = layer_store.stored_tensor

    def then_the_disk_fills(ckpt, name, *a, **k):
        if name.startswith("model.layers.1.") and not filler.exists():
            filler.write_bytes(b"x" * (layer_store.free_bytes(small_tmpfs) - 8192))
        return real(ckpt, name, *a, **k)

    monkeypatch.setattr(layer_store, "stored_tensor", then_the_disk_fills)
    with pytest.raises(UserError) as during:
        _build(folder, root)
    _caught("full_tmpfs_during_build", during.value, str(root), "filled up", "MiB) are free")
    assert _entries(root) == []
    # 3. the space back: the same build completes on the same tmpfs
    filler.unlink()
    monkeypatch.undo()
    assert _build(folder, root).path.stat().st_size == layout.total_bytes
    report({"tmpfs_1MiB": {"refused_before": str(before.value), "filled_during": str(during.value)}})


# ---- a store that reads back damaged ------------------------------------------------------------

def test_a_flipped_byte_fails_the_first_read_naming_the_layer(folder, cache):
    _load(folder).close()  # builds the store
    store, meta = _store_of(cache)
    _flip(store / "layers.bin", _block_offset(meta, 1) + 1000)
    engine = _load(folder)
    try:
        with pytest.raises(UserError) as e:
            engine.generate(PROMPT, max_new_tokens=4)
        _caught("checksum_mismatch_disk_tier", e.value, str(store / "layers.bin"), "layer 1:", "checksum mismatch")
        with pytest.raises(UserError, match="layer 1: checksum mismatch"):  # and stays stopped
            engine.generate(PROMPT, max_new_tokens=4)
    finally:
        engine.close()
    with pytest.raises(UserError) as e:  # RAM-tier layers are checked as they are loaded
        _load(folder, offload="ram")
    _caught("checksum_mismatch_ram_tier", e.value, str(store / "layers.bin"), "layer 1:", "checksum mismatch")


def test_a_truncated_store_file_stops_the_generation(folder, cache):
    engine = _load(folder)  # its loader has read layers 0 and 1 into its two buffers
    try:
        store, meta = _store_of(cache)
        os.truncate(store / "layers.bin", _block_offset(meta, 2) + 1000)
        with pytest.raises(UserError) as e:
            engine.generate(PROMPT, max_new_tokens=4)
        _caught("truncated_file", e.value, "layers.bin", "layer 2:", "short read")
    finally:
        engine.close()


def _failing_preadv(monkeypatch, cache, layer, action):
    """os.preadv calls reading block `layer` of the store do `action` instead."""
    real = os.preadv

    def preadv(fd, buffers, offset):
        link = os.readlink(f"/proc/self/fd/{fd}")
        if link.endswith("layers.bin"):
            _, meta = _store_of(cache)
            if _block_offset(meta, layer) <= offset < _block_offset(meta, layer + 1):
                return action(fd, buffers, offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)


def _eio(fd, buffers, offset):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def _nothing_read(fd, buffers, offset):
    return 0


@pytest.mark.parametrize("action, kind, needle", [(_eio, "io_error", "I/O error at byte"),
                                                  (_nothing_read, "short_read", "short read (0 of")])
def test_a_failing_read_stops_the_generation(folder, cache, monkeypatch, action, kind, needle):
    """...and a disk that recovers serves the next generation (a server is not stopped for good)."""
    reference = _load(folder).generate(PROMPT, max_new_tokens=4).token_ids
    real = os.preadv
    _failing_preadv(monkeypatch, cache, 2, action)
    engine = _load(folder)
    try:
        with pytest.raises(UserError) as e:
            engine.generate(PROMPT, max_new_tokens=4)
        _caught(kind, e.value, "layers.bin", "layer 2:", needle)
        if kind == "io_error":
            assert "EIO" in str(e.value)
        monkeypatch.setattr(os, "preadv", real)  # the disk's hiccup is over
        assert engine.generate(PROMPT, max_new_tokens=4).token_ids == reference
    finally:
        engine.close()


def test_verify_reads_catches_damage_after_the_first_read(folder, cache):
    reference = _load(folder, offload="none").generate(PROMPT, max_new_tokens=8).token_ids
    for verify in (False, True):
        shutil.rmtree(cache, ignore_errors=True)
        engine = _load(folder, verify_reads=verify)
        try:
            assert engine.generate(PROMPT, max_new_tokens=8).token_ids == reference  # checking changes nothing
            reader = engine.model.layers.reader
            passes = engine.model.layers.snapshot().target_passes
            # every read (the loader has read up to its 2 buffers ahead for the next pass), or each block once
            assert 3 * passes <= reader.checks <= 3 * passes + 2 if verify else reader.checks == 3
            store, meta = _store_of(cache)
            _flip(store / "layers.bin", _block_offset(meta, 0) + 64)
            if verify:
                with pytest.raises(UserError) as e:
                    engine.generate(PROMPT, max_new_tokens=8)
                _caught("checksum_mismatch_after_first_read", e.value, "layer 0:", "checksum mismatch")
            else:  # first-read checks only: the steady state reads without checking
                engine.generate(PROMPT, max_new_tokens=8)
        finally:
            engine.close()


def test_every_read_is_checked_only_when_asked(folder, tmp_path):
    """The reader's counts: each block checked once after the store is opened, or on every read
    (the cost of each mode is measured on a large store by benchmarks/verify_reads.py)."""
    store = _build(folder, tmp_path / "stores")
    buf = aligned_buffer(store.layout.max_block)
    for mode, reader in [("none", BlockReader(store.path, store.layout)), ("first", store.reader()),
                         ("every", store.reader(verify_every=True))]:
        for _ in range(20):
            for i in range(store.num_layers):
                reader.read(i, buf)
        assert reader.checks == {"none": 0, "first": 3, "every": 60}[mode]
        reader.close()
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy()
    t0 = time.perf_counter()
    chunk_checksums(data)
    bench = json.loads((REPO / "benchmarks" / "results_verify_reads.json").read_text())
    report({"crc32_gbps_in_test": round(data.nbytes / (time.perf_counter() - t0) / 1e9, 2),
            "verify_cost_benchmark": {k: bench[k] for k in ("store_bytes", "ratios")}})


def test_a_block_of_many_chunks_is_checked_chunk_by_chunk(tmp_path):
    """Blocks of 9 MiB: two full 4 MiB chunks and a 1 MiB one, checked on helper threads while
    the next chunk is read; the bytes come through whole, and damage names its chunk."""
    from benchmarks.verify_reads import make_store
    path, layout, sums = make_store(tmp_path, 27 << 20, 9 << 20)
    assert [len(c) for c in sums] == [3, 3, 3]
    buf, data = aligned_buffer(layout.max_block), path.read_bytes()
    reader = BlockReader(path, layout, checksums=sums, verify_every=True)
    for i in range(3):
        reader.read(i, buf)
        assert bytes(buf.numpy()) == data[i * (9 << 20): (i + 1) * (9 << 20)]
    _flip(path, (9 << 20) + (8 << 20) + 5)  # block 1, its third chunk
    with pytest.raises(UserError) as e:
        reader.read(1, buf)
    _caught("checksum_mismatch_third_chunk", e.value, "layer 1:",
            "checksum mismatch in bytes 8388608..9437184 of 9437184")
    reader.read(2, buf)  # the other blocks still read and check
    reader.close()


def test_a_store_without_checksums_is_rebuilt(folder, tmp_path):
    root = tmp_path / "stores"
    store = _build(folder, root)
    meta = json.loads((store.folder / "layout.json").read_text())
    assert len(meta["checksums"]) == 3 and meta["checksum"] == "crc32"
    del meta["checksums"]
    (store.folder / "layout.json").write_text(json.dumps(meta))
    again = _build(folder, root)
    assert again.checksums == store.checksums
    assert "checksums" in json.loads((again.folder / "layout.json").read_text())


def test_a_build_removes_the_same_checkpoint_s_stores_of_older_formats(folder, tmp_path):
    """After a format change the old store would be a second copy of the model on the disk:
    a build deletes it, and nothing else (other checkpoints, other current stores)."""
    root, source = tmp_path / "stores", str(folder.resolve())
    now = layer_store.FORMAT_VERSION
    for name, fmt, src in [("m-old", 3, source), ("m-other", 3, "/elsewhere/m"), ("m-current", now, source),
                           ("n-old", 3, source)]:
        (root / name).mkdir(parents=True)
        (root / name / "layers.bin").write_bytes(b"x" * 4096)
        (root / name / "layout.json").write_text(json.dumps({"format": fmt, "source": src}))
    store = _build(folder, root)
    assert _entries(root) == sorted(["m-other", "m-current", "n-old", store.folder.name])


def test_the_cli_prints_one_error_line_for_a_damaged_store(folder, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    _build(folder, cache / "sequoia-offload" / "stores")
    store, meta = _store_of(cache / "sequoia-offload" / "stores")
    _flip(store / "layers.bin", _block_offset(meta, 2) + 4096 * 3 + 5)
    run = subprocess.run([sys.executable, "-m", "offload_engine.apps.cli", "generate", "--target", str(folder), "--draft", "none",
                          "--device", "cpu", "--offload", "disk", "--max-new-tokens", "3", "--prompt", PROMPT],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("sequoia-offload: error: "), run.stderr
    _caught("cli_checksum_mismatch", errors[0], "layers.bin", "layer 2:", "checksum mismatch")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_verify_reads_reaches_the_engine_from_the_cli(command, monkeypatch):
    from offload_engine.apps import cli
    seen = {}
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **kw: seen.update(kw)))
    extra = ["--prompt", "x"] if command == "generate" else []
    for flag, expected in ([], False), (["--verify-reads"], True):
        cli._load(cli.build_parser().parse_args([command, *extra, *flag]))
        assert seen["verify_reads"] is expected


def test_a_server_answers_503_for_a_damaged_store_and_keeps_serving(folder, cache):
    """The store is the server's, not the request's: 503 with the file and layer, not a 400."""
    from fastapi.testclient import TestClient

    from offload_engine.apps.server import create_app
    _load(folder).close()
    store, meta = _store_of(cache)
    _flip(store / "layers.bin", _block_offset(meta, 1) + 1000)
    engine = _load(folder)
    try:
        with TestClient(create_app(engine, "m")) as client:
            for _ in range(2):  # the next request is answered too (the worker lives on)
                r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
                err = r.json()["error"]
                assert r.status_code == 503 and err["type"] == "server_error", r.text
                _caught("checksum_mismatch_server", err["message"], "layer 1:", "checksum mismatch")
            assert client.get("/health").json()["failed"] == 2
    finally:
        engine.close()


def test_a_filesystem_that_cannot_sync_a_folder_still_publishes(folder, tmp_path, monkeypatch):
    """9p, vboxsf or CIFS refuse fsync on a folder (EINVAL): the store is built and used anyway;
    a file that cannot be synced is still an error."""
    from offload_engine import fsutil
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = _build(folder, tmp_path / "stores")
    assert (store.folder / "layers.bin").is_file()
    fsutil.fsync_path(store.folder)  # refused by the filesystem: nothing to do

    def fsync_fails(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError):  # a file's bytes that cannot be synced are not published
        fsutil.fsync_path(store.folder / "layout.json")
