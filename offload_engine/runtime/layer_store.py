"""The packed layer store: every decoder layer as one contiguous, 4 KiB-aligned block on disk.

All layers of a model have the same tensor shapes, so one `LayerLayout` says where each tensor
sits inside a block (offsets aligned to 256 bytes); block i starts at i * block_bytes. Moving a
layer is then one copy, and reading it from disk is one aligned O_DIRECT read.

The store is built once from the checkpoint into the cache folder (in a temporary folder that is
renamed into place when complete) and keyed by the checkpoint's files and the dtype, so a changed
checkpoint or dtype gets a new store and a half-built one is never trusted.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import UserError
from ..formats.checkpoint import Checkpoint, layer_shapes
from ..formats.config import DTYPE_NAMES, ModelConfig
from ..fsutil import remove_stale_temps

FORMAT_VERSION = 1
BLOCK_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length all multiples of this
TENSOR_ALIGN = 256


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class TensorSlot:
    name: str  # relative to "model.layers.{i}."
    offset: int  # bytes from the block's start
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayerLayout:
    dtype: torch.dtype
    slots: tuple[TensorSlot, ...]
    block_bytes: int

    @staticmethod
    def for_config(cfg: ModelConfig, dtype: torch.dtype) -> "LayerLayout":
        elt = torch.empty((), dtype=dtype).element_size()
        slots, offset = [], 0
        for name, shape in layer_shapes(cfg).items():
            slots.append(TensorSlot(name, offset, tuple(shape)))
            n = 1
            for d in shape:
                n *= d
            offset = _round_up(offset + n * elt, TENSOR_ALIGN)
        return LayerLayout(dtype, tuple(slots), _round_up(offset, BLOCK_ALIGN))

    def views(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensors over a uint8 block [block_bytes], on whatever device the block is."""
        out = {}
        elt = torch.empty((), dtype=self.dtype).element_size()
        for s in self.slots:
            n = 1
            for d in s.shape:
                n *= d
            out[s.name] = block[s.offset: s.offset + n * elt].view(self.dtype).view(s.shape)
        return out

    def pack(self, weights: dict[str, torch.Tensor], block: torch.Tensor) -> None:
        block.zero_()
        for name, view in self.views(block).items():
            view.copy_(weights[name])

    def to_json(self) -> dict:
        return {"dtype": DTYPE_NAMES[self.dtype], "block_bytes": self.block_bytes,
                "slots": [[s.name, s.offset, list(s.shape)] for s in self.slots]}


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor (an anonymous mmap: what O_DIRECT reads need).

    Transparent huge pages are turned off for it: measured on this project's machines, O_DIRECT
    reads into THP-backed buffers ran at half the speed of reads into 4 KiB pages.
    """
    mm = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "non-writable buffer" is not the case for an mmap
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)  # keeps `mm` alive


class BlockReader:
    """Reads whole layer blocks from the store file, bypassing the page cache (O_DIRECT).

    Where the filesystem refuses O_DIRECT (tmpfs), it falls back to buffered reads followed by
    posix_fadvise(DONTNEED), which also keeps the page cache from serving later passes.
    """

    def __init__(self, path: Path, block_bytes: int, direct: bool = True):
        self.path, self.block_bytes = path, block_bytes
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError as e:
            if not self.direct:
                raise UserError(f"{path}: cannot open the layer store ({e.strerror})") from None
            warnings.warn(f"{path}: O_DIRECT refused ({e.strerror}); using buffered reads + fadvise(DONTNEED)")
            self.direct = False
            self.fd = os.open(path, os.O_RDONLY)

    def read(self, layer: int, out: torch.Tensor) -> int:
        """Fill `out` (uint8 [block_bytes], page-aligned when direct) with block `layer`; returns
        the bytes the reads returned (what the executor counts as read from disk)."""
        view = memoryview(out.numpy())
        offset, done = layer * self.block_bytes, 0
        while done < self.block_bytes:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0 or (self.direct and n % BLOCK_ALIGN):  # a short O_DIRECT read: EOF
                raise UserError(f"{self.path}: layer {layer} ends early (file truncated?)")
            done += n
        if not self.direct:
            os.posix_fadvise(self.fd, offset, self.block_bytes, os.POSIX_FADV_DONTNEED)
        return done

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LayerStore:
    """A built store: `layers.bin` (num_layers blocks) and `layout.json` in one folder."""

    def __init__(self, folder: Path, layout: LayerLayout, num_layers: int):
        self.folder, self.layout, self.num_layers = folder, layout, num_layers
        self.path = folder / "layers.bin"

    def reader(self, direct: bool = True) -> BlockReader:
        return BlockReader(self.path, self.layout.block_bytes, direct)

    def load_block(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """One block into RAM through the page cache (used once, at load time, for RAM-tier layers)."""
        out = out if out is not None else torch.empty(self.layout.block_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(layer * self.layout.block_bytes)
            if f.readinto(memoryview(out.numpy())) != self.layout.block_bytes:
                raise UserError(f"{self.path}: layer {layer} ends early (file truncated?)")
        return out


def store_key(folder: Path, cfg_text: bytes, dtype: torch.dtype) -> str:
    """Changes with the checkpoint's files (name, size, mtime), its config, the dtype and the format."""
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{DTYPE_NAMES[dtype]}|{folder.resolve()}".encode())
    h.update(cfg_text)
    for p in sorted(folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"|{p.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _valid(folder: Path, layout: LayerLayout, num_layers: int) -> bool:
    try:
        meta = json.loads((folder / "layout.json").read_text())
        size = (folder / "layers.bin").stat().st_size
    except (OSError, json.JSONDecodeError):
        return False
    return (meta.get("format") == FORMAT_VERSION and meta.get("layout") == layout.to_json()
            and meta.get("num_layers") == num_layers and size == num_layers * layout.block_bytes)


def open_or_build(ckpt: Checkpoint, dtype: torch.dtype, root: Path, progress: bool = True) -> LayerStore:
    """The store for (checkpoint, dtype) under `root`, built first if missing or invalid."""
    cfg = ckpt.config
    layout = LayerLayout.for_config(cfg, dtype)
    key = store_key(ckpt.folder, (ckpt.folder / "config.json").read_bytes(), dtype)
    target = root / f"{ckpt.folder.resolve().name}-{key}"
    if _valid(target, layout, cfg.num_layers):
        return LayerStore(target, layout, cfg.num_layers)
    if target.exists():  # wrong size or layout: never trusted, rebuilt
        shutil.rmtree(target, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root, ".*.tmp-*")
    tmp = root / f".{target.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _write_store(ckpt, layout, tmp, progress)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _valid(target, layout, cfg.num_layers):  # not a concurrent build that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return LayerStore(target, layout, cfg.num_layers)


def _write_store(ckpt: Checkpoint, layout: LayerLayout, tmp: Path, progress: bool) -> None:
    cfg = ckpt.config
    block = torch.empty(layout.block_bytes, dtype=torch.uint8)
    bar = tqdm(range(cfg.num_layers), desc="building layer store", unit="layer", leave=False,
               disable=None if progress else True)
    with open(tmp / "layers.bin", "wb") as f:
        for i in bar:
            layout.pack(ckpt.load_layer(i, layout.dtype), block)
            f.write(memoryview(block.numpy()))
        f.flush()
        os.fsync(f.fileno())
    meta = {"format": FORMAT_VERSION, "num_layers": cfg.num_layers, "layout": layout.to_json(),
            "source": str(ckpt.folder.resolve())}
    (tmp / "layout.json").write_text(json.dumps(meta, indent=1))
