"""A GGUF file's header walked with every length and count checked, before the gguf package reads it,
and its metadata values read with their types and ranges checked.

The gguf package's reader trusts what it reads: an array claiming 2^63 items makes it loop for
ever past the end of the file (each missing item reads as zero bytes), and a few MiB of file can
claim millions of items, each of which becomes a Python object. This walk reads the same fields
against the bytes that are there, allocating nothing per item, and refuses with the key, tensor
and number at fault (a UserError; the runtime's own error for a file from the internet).
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any

from ..errors import UserError

MAX_ARRAY_ITEMS = 1 << 22  # 4M; the largest vocabularies and merge lists have under 300k entries
MAX_DIMS = 4  # GGML_MAX_DIMS
VERSIONS = (2, 3)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _U32 = 8, 9, 4
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


class _Walk:
    """A cursor over the file's bytes that refuses to read past their end."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos = path, buf, 0

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> int:
        if n > self.left():
            raise UserError(f"{self.path}: {what} needs {n} bytes at offset {self.pos}, but the file ends at "
                            f"{len(self.buf)} (truncated or damaged file?)")
        start, self.pos = self.pos, self.pos + n
        return start

    def int(self, fmt: str, what: str) -> int:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def text(self, what: str) -> str:
        n = self.int("<Q", f"the length of {what}")
        start = self.take(n, f"{what} ({n} bytes)")
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{self.path}: {what} is not UTF-8 text") from None

    def skip_string(self, what: str) -> None:
        n = self.int("<Q", f"the length of {what}")
        self.take(n, f"{what} ({n} bytes)")

    def value(self, vtype: int, what: str) -> Any:
        """Skips a value (returns a u32's value: general.alignment needs it)."""
        if vtype == _U32:
            return self.int("<I", what)
        if vtype in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[vtype], what)
        elif vtype == _STRING:
            self.skip_string(what)
        elif vtype == _ARRAY:
            self.array(what)
        else:
            raise UserError(f"{self.path}: {what} has unknown value type {vtype}")
        return None

    def array(self, what: str) -> None:
        itype = self.int("<I", f"the item type of {what}")
        count = self.int("<Q", f"the length of {what}")
        if itype == _ARRAY:
            raise UserError(f"{self.path}: {what} is an array of arrays, which GGUF readers do not support")
        if itype not in _SCALAR_BYTES and itype != _STRING:
            raise UserError(f"{self.path}: {what} holds items of unknown type {itype}")
        size = _SCALAR_BYTES.get(itype, 8)  # a string takes at least its 8-byte length
        if count > MAX_ARRAY_ITEMS or count * size > self.left():
            raise UserError(f"{self.path}: {what} claims {count} items, more than the file holds "
                            f"({self.left()} bytes left) or than {MAX_ARRAY_ITEMS} (damaged file?)")
        if itype != _STRING:
            self.take(count * size, f"{what} ({count} items)")
            return
        for i in range(count):
            self.skip_string(f"{what}[{i}]")


def check_layout(path: Path) -> None:
    """Walk the header of GGUF file `path` (magic already checked): version, counts, every metadata
    value and tensor record, and each tensor's bytes against the file's size."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        w = _Walk(path, buf)
        w.take(4, "the magic")
        version = w.int("<I", "the version")
        if version & 0xFFFF == 0 and version:
            raise UserError(f"{path}: a big-endian GGUF file; only little-endian files are supported")
        if version not in VERSIONS:
            raise UserError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors, n_kv = w.int("<Q", "the tensor count"), w.int("<Q", "the metadata count")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > w.left():
            raise UserError(f"{path}: the header claims {n_kv} metadata values and {n_tensors} tensors, more than "
                            f"its {len(buf)} bytes can hold (damaged file?)")
        alignment = _metadata(w, n_kv)
        tensors = [_tensor_record(w, i) for i in range(n_tensors)]
        data_start = -(-w.pos // alignment) * alignment
        _tensor_bytes(path, tensors, data_start, len(buf))


def _metadata(w: _Walk, count: int) -> int:
    """Skips `count` metadata values; returns general.alignment (32 when absent)."""
    seen, alignment = set(), 32
    for i in range(count):
        key = w.text(f"metadata key #{i}")
        if key in seen:
            raise UserError(f"{w.path}: metadata key {key!r} appears twice")
        seen.add(key)
        vtype = w.int("<I", f"the type of metadata {key!r}")
        value = w.value(vtype, f"metadata {key!r}")
        if key == "general.alignment":
            if vtype != _U32 or not value or value & (value - 1):
                raise UserError(f"{w.path}: general.alignment must be a power of two (uint32), got {value}")
            alignment = value
    return alignment


def _tensor_record(w: _Walk, i: int) -> tuple[str, list[int], int, int]:
    name = w.text(f"the name of tensor #{i}")
    n_dims = w.int("<I", f"the dimension count of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise UserError(f"{w.path}: tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
    dims = [w.int("<Q", f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
    qtype = w.int("<I", f"the type of tensor {name!r}")
    offset = w.int("<Q", f"the data offset of tensor {name!r}")
    return name, dims, qtype, offset


def _tensor_bytes(path: Path, tensors: list, data_start: int, size: int) -> None:
    """Every tensor's type is known, its size whole blocks, its bytes inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    names = set()
    for name, dims, qtype, offset in tensors:
        if name in names:
            raise UserError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise UserError(f"{path}: tensor {name!r} has unknown type {qtype}") from None
        count = math.prod(dims)
        if count % block:
            raise UserError(f"{path}: tensor {name!r} has {count} values, not whole blocks of {block}")
        need = count // block * block_bytes
        if data_start + offset + need > size:
            raise UserError(f"{path}: tensor {name!r} (shape {dims}) needs {need} bytes at offset "
                            f"{data_start + offset}, but the file ends at {size} (truncated or damaged file?)")


# ---- metadata values, type- and range-checked -------------------------------------------------------

def shown(value: Any) -> str:
    """A value for a message: its repr, cut at 60 characters (a file's value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def meta_int(path: Path, meta: dict, key: str, default: int | None = None, low: int = 1,
             high: int = 1 << 31) -> int:
    """A whole number in low..high; missing (or 0 where the default is given) means `default`."""
    value = meta.get(key)
    if value is None or (value == 0 and default is not None and low > 0):
        if default is None:
            raise UserError(f"{path}: metadata key {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{path}: metadata {key} must be a whole number in {low}..{high}, got {shown(value)}")
    return value


def meta_float(path: Path, meta: dict, key: str, default: float) -> float:
    """A finite positive number; missing means `default`."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise UserError(f"{path}: metadata {key} must be a finite positive number, got {shown(value)}")
    return float(value)


def meta_list(path: Path, meta: dict, key: str, kind: type | tuple) -> list:
    """A list whose items are all `kind` ([] when missing)."""
    value = meta.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise UserError(f"{path}: metadata {key} must be a list of "
                        f"{'text' if kind is str else 'numbers'}, got {shown(value)}")
    return value
