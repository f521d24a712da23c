"""The packed layer store: every decoder layer as one contiguous, 4 KiB-aligned block on disk.

A `LayerLayout` says where each tensor of a layer sits inside its block (offsets aligned to 256
bytes) and in which storage format (runtime/blocks.py): the compute dtype, a narrower float, or a
GGUF block format kept as the file holds it or made by `--weights`. Layers of one model share
their shapes but not always their formats (a Q4_K_M file keeps some matrices in Q6_K), so the
`StoreLayout` holds one layout per layer and blocks are laid end to end. Moving a layer is one
copy, and reading it from disk is one aligned O_DIRECT read of exactly its bytes.

The store is built once from the checkpoint into the cache folder (in a temporary folder that is
renamed into place when complete) and keyed by the checkpoint's files, the compute dtype and the
`--weights` choice, so a changed checkpoint or choice gets a new store and a half-built one is
never trusted. A build checks the free space first and turns a disk that fills up meanwhile into
one clear error, leaving nothing behind.

The CRC-32 of each 4 MiB chunk of each block is written into `layout.json` at build time and
checked as blocks are read back (runtime/block_reader.py): on a block's first read after the store
is opened, and on every read with `--verify-reads`; RAM-tier blocks when they are loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import UserError
from ..formats.checkpoint import layer_shapes
from ..formats.config import DTYPE_NAMES, ModelConfig
from ..fsutil import fsync_path, remove_stale_temps
from .block_reader import (BLOCK_ALIGN, CHECK_CHUNK, BlockChecker, BlockReader, chunk_checksums, io_error,
                           read_error)
from .blocks import (FLOAT_FORMATS, FORMAT_OF_DTYPE, PackedWeight, check_shape, quantize, storage_format, tensor_bytes,
                     to_dense)

FORMAT_VERSION = 4  # 3: the torch quantizers divide exactly on CUDA too; 4: CRC-32s per 4 MiB chunk
TENSOR_ALIGN = 256
META_BYTES = 64 << 10  # room counted for layout.json's layouts and the folder (a 70B's are ~10 KiB)
CHECKSUM_JSON_BYTES = 16  # and for each chunk's CRC-32 in it (at most 10 digits, a comma, indent)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class TensorSlot:
    name: str  # relative to "model.layers.{i}."
    offset: int  # bytes from the block's start
    shape: tuple[int, ...]
    fmt: str = "F32"  # storage format (runtime/blocks.py): a GGUF block format or F32/F16/BF16

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.fmt, self.shape)


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's tensors sit in its block, and in which format; `dtype` is the compute
    dtype the layer runs in (a slot in another format is converted before it is used)."""
    dtype: torch.dtype
    slots: tuple[TensorSlot, ...]
    block_bytes: int

    @staticmethod
    def for_config(cfg: ModelConfig, dtype: torch.dtype, formats: dict[str, str] | None = None) -> "LayerLayout":
        """Every tensor in the compute dtype, or in `formats[name]` where given."""
        slots, offset = [], 0
        for name, shape in layer_shapes(cfg).items():
            fmt = (formats or {}).get(name, FORMAT_OF_DTYPE[dtype])
            slot = TensorSlot(name, offset, tuple(shape), fmt)
            slots.append(slot)
            offset = _round_up(offset + slot.nbytes, TENSOR_ALIGN)
        return LayerLayout(dtype, tuple(slots), _round_up(offset, BLOCK_ALIGN))

    @property
    def packed(self) -> tuple[str, ...]:
        """The slots stored in another format than the compute dtype."""
        compute = FORMAT_OF_DTYPE[self.dtype]
        return tuple(s.name for s in self.slots if s.fmt != compute)

    def views(self, block: torch.Tensor) -> dict[str, torch.Tensor | PackedWeight]:
        """The layer's tensors over a uint8 block, on whatever device the block is: typed views
        for compute-dtype slots, `PackedWeight`s over the bytes of the others."""
        out: dict[str, torch.Tensor | PackedWeight] = {}
        compute = FORMAT_OF_DTYPE[self.dtype]
        for s in self.slots:
            raw = block[s.offset: s.offset + s.nbytes]
            out[s.name] = raw.view(self.dtype).view(s.shape) if s.fmt == compute else \
                PackedWeight(raw, s.fmt, s.shape, self.dtype)
        return out

    def pack(self, stored: dict[str, torch.Tensor], block: torch.Tensor) -> None:
        """stored: each slot's bytes in its format (any tensor whose bytes are the stored ones)."""
        block.zero_()
        for s in self.slots:
            data = stored[s.name].contiguous().reshape(-1).view(torch.uint8)
            if data.numel() != s.nbytes:
                raise ValueError(f"{s.name}: {data.numel()} bytes for a {s.fmt} slot of {s.nbytes}")
            block[s.offset: s.offset + s.nbytes].copy_(data)

    def to_json(self) -> dict:
        return {"dtype": DTYPE_NAMES[self.dtype], "block_bytes": self.block_bytes,
                "slots": [[s.name, s.offset, list(s.shape), s.fmt] for s in self.slots]}

    def formats(self) -> str:
        """'Q4_1 x7, F32 x2'-style summary."""
        counts: dict[str, int] = {}
        for s in self.slots:
            counts[s.fmt] = counts.get(s.fmt, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in counts.items())


@dataclass(frozen=True)
class StoreLayout:
    """Every layer's layout (layers may differ: a Q4_K_M file keeps some of its matrices in
    Q6_K) and where its block starts in the store file; blocks are 4 KiB aligned."""
    layouts: tuple[LayerLayout, ...]

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(lay.block_bytes for lay in self.layouts)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at += size
        return tuple(out)

    @property
    def max_block(self) -> int:
        return max(self.sizes)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def packed_slots(self, layers=None) -> list[TensorSlot]:
        """The slots the layers (of `layers`, default all) keep in another format than the compute dtype."""
        picks = range(len(self.layouts)) if layers is None else layers
        return [s for i in picks for s in self.layouts[i].slots if s.name in self.layouts[i].packed]

    def packed_shapes(self, layers=None) -> dict[str, tuple[int, ...]]:
        """Every slot name some of those layers keep packed, with its shape: the compute-dtype
        scratch a layer buffer needs to convert any of them."""
        return {s.name: s.shape for s in self.packed_slots(layers)}

    def scratch_bytes(self, layers=None) -> int:
        dtype = self.layouts[0].dtype
        return sum(math.prod(shape) for shape in self.packed_shapes(layers).values()) * dtype.itemsize

    def to_json(self) -> dict:
        distinct: list[dict] = []
        index = []
        for lay in self.layouts:
            j = lay.to_json()
            if j not in distinct:
                distinct.append(j)
            index.append(distinct.index(j))
        return {"layouts": distinct, "layer_layout": index}

    def summary(self) -> str:
        """The formats of the layer blocks, as people name them."""
        kinds: dict[str, int] = {}
        for lay in self.layouts:
            kinds[lay.formats()] = kinds.get(lay.formats(), 0) + 1
        return "; ".join(f"{n} layers: {k}" if len(kinds) > 1 else k for k, n in kinds.items())


def store_layout(ckpt, dtype: torch.dtype, weights: str = "auto") -> StoreLayout:
    """The layout of the store for (checkpoint, compute dtype, --weights), from the checkpoint's
    headers alone (no tensor data is read)."""
    cfg = ckpt.config
    sources = ckpt.source_formats()
    layouts, cache = [], {}
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        formats = {}
        for name, shape in layer_shapes(cfg).items():
            source = sources[prefix + name]
            fmt = storage_format(source, shape, dtype, weights)
            if fmt not in FLOAT_FORMATS and fmt != source:
                check_shape(fmt, shape, prefix + name)
            formats[name] = fmt
        key = tuple(sorted(formats.items()))
        if key not in cache:
            cache[key] = LayerLayout.for_config(cfg, dtype, formats)
        layouts.append(cache[key])
    return StoreLayout(tuple(layouts))


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


class LayerStore:
    """A built store: `layers.bin` (num_layers blocks) and `layout.json` (with the CRC-32 of
    each 4 MiB chunk of each block) in one folder."""

    def __init__(self, folder: Path, layout: StoreLayout, checksums: tuple[tuple[int, ...], ...] | None = None):
        self.folder, self.layout, self.num_layers = folder, layout, len(layout.layouts)
        self.path = folder / "layers.bin"
        self.checksums = checksums

    def reader(self, direct: bool = True, verify_every: bool = False) -> BlockReader:
        """A reader checking each block on its first read (every read with `verify_every`)."""
        return BlockReader(self.path, self.layout, direct, self.checksums, verify_every)

    def load_block(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """One block into RAM through the page cache, checked (used once, at load time, for
        RAM-tier layers)."""
        size = self.layout.sizes[layer]
        out = out if out is not None else torch.empty(size, dtype=torch.uint8)
        view = memoryview(out.numpy())[:size]
        try:
            with open(self.path, "rb") as f:
                f.seek(self.layout.offsets[layer])
                n = f.readinto(view)
        except OSError as e:
            raise io_error(self.path, layer, e) from None
        if n != size:
            raise read_error(self.path, layer, f"short read ({n} of {size} bytes: file truncated?)")
        if self.checksums is not None:
            checker = BlockChecker(self.path, self.checksums)
            try:
                checker.check(layer, view)
            finally:
                checker.close()
        return out


def store_key(folder: Path, cfg_text: bytes, dtype: torch.dtype, weights: str = "auto") -> str:
    """Changes with the checkpoint's files (name, size, mtime), its config, the dtype, the
    --weights choice and the format."""
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{DTYPE_NAMES[dtype]}|{weights}|{folder.resolve()}".encode())
    h.update(cfg_text)
    for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("gguf.json")):
        st = p.stat()
        h.update(f"|{p.name}|{st.st_size}|{st.st_mtime_ns}".encode())
        if p.name == "gguf.json":
            h.update(p.read_bytes())  # names the GGUF file, its size and mtime
    return h.hexdigest()[:16]


def _stored_checksums(folder: Path, layout: StoreLayout) -> tuple[tuple[int, ...], ...] | None:
    """Each block's chunk CRCs, when `folder` holds a complete store of this layout; else None."""
    try:
        meta = json.loads((folder / "layout.json").read_text())
        size = (folder / "layers.bin").stat().st_size
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT_VERSION and meta.get("layout") == layout.to_json()
            and meta.get("num_layers") == len(layout.layouts) and size == layout.total_bytes
            and meta.get("checksum_chunk_bytes") == CHECK_CHUNK):
        return None
    sums = meta.get("checksums")
    chunks = [-(-n // CHECK_CHUNK) for n in layout.sizes]
    if not (isinstance(sums, list) and len(sums) == len(chunks)
            and all(isinstance(c, list) and len(c) == k for c, k in zip(sums, chunks))
            and all(isinstance(x, int) and 0 <= x < 2**32 for c in sums for x in c)):
        return None
    return tuple(tuple(c) for c in sums)


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged process may still write on `folder`'s filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def bytes_needed(layout: StoreLayout) -> int:
    """The disk space a store takes: its blocks, layout.json and the folder."""
    chunks = sum(-(-n // CHECK_CHUNK) for n in layout.sizes)  # a 70B in bf16: ~33k CRCs, ~0.5 MB of JSON
    return layout.total_bytes + META_BYTES + CHECKSUM_JSON_BYTES * chunks


def no_space_error(root: Path, needed: int, free: int, during: bool) -> UserError:
    when = "the disk filled up while the layer store was written: " if during else ""
    return UserError(f"{root}: {when}the layer store needs {needed} bytes ({needed / 2**20:.1f} MiB) and "
                     f"{free} bytes ({free / 2**20:.1f} MiB) are free; free some space there, or set "
                     f"XDG_CACHE_HOME to a folder on a larger disk")


def open_or_build(ckpt, dtype: torch.dtype, root: Path, progress: bool = True, weights: str = "auto",
                  layout: StoreLayout | None = None, device: torch.device | None = None) -> LayerStore:
    """The store for (checkpoint, dtype, weights) under `root`, built first if missing or invalid
    (quantizing on `device` when given: a GPU makes a 70B store in minutes)."""
    layout = layout or store_layout(ckpt, dtype, weights)
    key = store_key(ckpt.folder, (ckpt.folder / "config.json").read_bytes(), dtype, weights)
    target = root / f"{ckpt.folder.resolve().name}-{key}"
    sums = _stored_checksums(target, layout)
    if sums is None:
        _build(ckpt, layout, root, target, progress, weights, device)
        sums = _stored_checksums(target, layout)
        if sums is None:
            raise UserError(f"{target}: the layer store just built does not read back whole")
    return LayerStore(target, layout, sums)


def _build(ckpt, layout: StoreLayout, root: Path, target: Path, progress: bool, weights: str,
           device: torch.device | None) -> None:
    """Build the store in a temporary folder renamed to `target` when complete. A disk without
    room for it (checked first, and again when a write finds it full) is a UserError naming the
    folder, the bytes needed and the bytes free, and leaves no partial store."""
    if target.exists():  # wrong size or layout: never trusted, rebuilt
        shutil.rmtree(target, ignore_errors=True)
    _remove_superseded(root, ckpt.folder)
    needed = bytes_needed(layout)
    tmp = root / f".{target.name}.tmp-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(root, ".*.tmp-*")
        if free_bytes(root) < needed:
            raise no_space_error(root, needed, free_bytes(root), during=False)
        tmp.mkdir()
        _write_store(ckpt, layout, tmp, progress, weights, device)
        fsync_path(tmp)  # its entries (the files' bytes are synced as written), then the rename
        try:
            os.rename(tmp, target)
        except OSError:
            if _stored_checksums(target, layout) is None:  # not a concurrent build that won
                raise
        fsync_path(root)  # a power cut keeps the new name
    except OSError as e:
        if e.errno not in _DISK_FULL:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # what it held is free again before counting
        raise no_space_error(root, needed, free_bytes(root), during=True) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def stored_tensor(ckpt, name: str, fmt: str, device: torch.device | None = None) -> torch.Tensor:
    """A tensor's bytes in storage format `fmt` (on the CPU): the checkpoint's own blocks when it
    holds that format, else its weights cast, or dequantized to float32 and quantized as the gguf
    package does (`blocks.quantize`, on `device` when given)."""
    if fmt in FLOAT_FORMATS:
        return ckpt.load(name, FLOAT_FORMATS[fmt])
    if hasattr(ckpt, "raw") and ckpt.qtype(name) == fmt:
        return ckpt.raw(name)
    return quantize(ckpt.load(name, torch.float32, device or "cpu"), fmt).cpu()


def dense_layer(ckpt, index: int, layout: LayerLayout, device: torch.device) -> dict:
    """Layer `index` in the compute dtype on `device`, made from its stored formats: a resident
    layer holds exactly the weights it would run with streamed (a --weights q4_0 model is that
    model wherever its layers live)."""
    compute, out = FORMAT_OF_DTYPE[layout.dtype], {}
    for s in layout.slots:
        name = f"model.layers.{index}.{s.name}"
        if s.fmt == compute:
            out[s.name] = ckpt.load(name, layout.dtype, device)
        else:
            out[s.name] = to_dense(stored_tensor(ckpt, name, s.fmt, device).to(device), s.fmt, s.shape, layout.dtype)
    return out


def packed_layer(ckpt, index: int, layout: LayerLayout, device: torch.device) -> dict:
    """Layer `index` kept in its stored formats on `device` (one block; packed slots become
    `PackedWeight`s dequantized per use)."""
    block = torch.empty(layout.block_bytes, dtype=torch.uint8)
    layout.pack({s.name: stored_tensor(ckpt, f"model.layers.{index}.{s.name}", s.fmt) for s in layout.slots}, block)
    return layout.views(block.to(device))


def _remove_superseded(root: Path, source: Path) -> None:
    """Delete the stores of `source` in an older store format: no version of this code reads
    them again, and after a format change they would hold a second copy of the model."""
    for meta_path in root.glob(f"{source.resolve().name}-*/layout.json"):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if (isinstance(meta, dict) and meta.get("source") == str(source.resolve())
                and isinstance(meta.get("format"), int) and meta["format"] < FORMAT_VERSION):
            shutil.rmtree(meta_path.parent, ignore_errors=True)


def _write_store(ckpt, layout: StoreLayout, tmp: Path, progress: bool, weights: str,
                 device: torch.device | None) -> None:
    block = torch.empty(layout.max_block, dtype=torch.uint8)
    bar = tqdm(range(len(layout.layouts)), desc=f"building layer store ({weights} weights)", unit="layer",
               leave=False, disable=None if progress else True)
    sums = []
    fd = os.open(tmp / "layers.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for i in bar:
            os.utime(tmp)  # a live build: never swept as a dead one's leftovers, however long it takes
            lay = layout.layouts[i]
            stored = {s.name: stored_tensor(ckpt, f"model.layers.{i}.{s.name}", s.fmt, device) for s in lay.slots}
            lay.pack(stored, block[:lay.block_bytes])
            data = memoryview(block[:lay.block_bytes].numpy())
            sums.append(chunk_checksums(data))
            _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    meta = {"format": FORMAT_VERSION, "num_layers": len(layout.layouts), "layout": layout.to_json(),
            "weights": weights, "source": str(ckpt.folder.resolve()), "checksum": "crc32",
            "checksum_chunk_bytes": CHECK_CHUNK, "checksums": sums}
    with open(tmp / "layout.json", "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=1))
        f.flush()
        os.fsync(f.fileno())


def _write_all(fd: int, data: memoryview) -> None:
    """os.write until every byte is written (a write may take fewer; a full disk raises ENOSPC)."""
    while data:
        data = data[os.write(fd, data):]
