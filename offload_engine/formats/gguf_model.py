"""A GGUF file used as it is, with no 16-bit conversion.

The file's configuration and tokenizer are written once into a small folder in the cache (the
sidecar: config.json, tokenizer.json, tokenizer_config.json, generation_config.json and
`gguf.json`, which names the file), so everything that reads a checkpoint folder reads it as
it reads a Hugging Face one. Its tensors stay in the file: `GGUFCheckpoint` serves them
dequantized (`load`, what resident weights and drafts use) or as the file's own blocks in Hugging
Face row order (`raw`, what the layer store packs and streams).

A model named by a GGUF path, or a folder holding exactly one GGUF file and no config.json,
resolves to its sidecar (`sidecar_for`).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..fsutil import cache_root, remove_stale_temps
from . import gguf_blocks, gguf_import
from .config import ModelConfig

SIDECAR_FILE = "gguf.json"
SIDECAR_FORMAT = 2  # bumped when gguf.json's content changes: older sidecars are rewritten


def is_sidecar(folder: Path) -> bool:
    return (Path(folder) / SIDECAR_FILE).is_file()


def display_name(folder: Path) -> str:
    """What to call a model: its GGUF file's name without .gguf, or its folder's name."""
    folder = Path(folder)
    if is_sidecar(folder):
        try:
            name = Path(json.loads((folder / SIDECAR_FILE).read_text(encoding="utf-8"))["file"]).name
            if name.endswith(".gguf"):
                return name.removesuffix(".gguf")
            return folder.name.rsplit("-gguf-", 1)[0]  # a blob (Ollama's sha256-...): the name it was loaded by
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return folder.name


def gguf_in(folder: Path) -> Path | None:
    """The one GGUF file of a folder that is not a Hugging Face checkpoint, else None."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        raise UserError(f"{folder}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                        "name the one to load")
    return found[0] if found else None


def _key(path: Path) -> str:
    st = path.stat()
    text = f"v{gguf_import.FORMAT_VERSION}.{SIDECAR_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _complete(folder: Path) -> bool:
    """The folder is whole: its files parse (a power cut may leave an empty one behind a rename
    that did happen; such a folder is written again)."""
    try:
        for name in ("config.json", "tokenizer.json", SIDECAR_FILE):
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        return isinstance(data, dict) and isinstance(data.get("tensors"), list)
    except (OSError, ValueError):
        return False


def sidecar_for(path: Path, progress: bool = True, name: str | None = None) -> Path:
    """The sidecar folder of GGUF file `path`, written first when missing (atomically: a
    temporary folder renamed into place). It changes with the file's path, size and mtime."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file")
    stem = name or path.name.removesuffix(".gguf")
    target = cache_root() / "models" / f"{stem}-gguf-{_key(path)}"
    if _complete(target):
        return target
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target.parent, f".{target.name}.tmp-*")
    try:
        return gguf_import.convert_gguf(path, target, dtype=torch.float32, progress=progress, weights=False)
    except gguf_import.OutputExistsError:
        if _complete(target):  # a concurrent run finished first (renames are atomic)
            return target
        raise UserError(f"{target}: exists but is not a GGUF model folder; delete it and retry") from None


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the file, as the sidecar records it (read once with the gguf package)."""
    hf_name: str
    shape: tuple[int, ...]
    unpermute_heads: int
    gguf_name: str = ""  # "" for a bias the file lacks (zeros)
    qtype: str = "F32"
    offset: int = 0  # of its data, from the file's start
    n_bytes: int = 0


class GGUFCheckpoint:
    """The `formats.checkpoint.Checkpoint` interface over a sidecar's GGUF file. The tensor table
    comes from the sidecar (the gguf package's reader parses the whole vocabulary, seconds for a
    large one, so it runs once, when the sidecar is written); the bytes from a memory map."""

    def __init__(self, folder: str | Path, config: ModelConfig):
        self.folder, self.config = Path(folder), config
        try:
            meta = json.loads((self.folder / SIDECAR_FILE).read_text(encoding="utf-8"))
            self.path = Path(meta["file"])
            tensors = [_Tensor(t[0], tuple(t[1]), *t[2:]) for t in meta["tensors"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{self.folder / SIDECAR_FILE}: unreadable ({type(e).__name__}: {e})") from None
        try:
            st = self.path.stat()
        except OSError:
            raise UserError(f"{self.path}: the GGUF file this model folder names is gone") from None
        if (st.st_size, st.st_mtime_ns) != (meta.get("size"), meta.get("mtime_ns")):
            raise UserError(f"{self.path}: changed since {self.folder} was made from it; load the .gguf file itself")
        self.entries = {t.hf_name: t for t in tensors}
        self.shapes = {t.hf_name: t.shape for t in tensors}
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if st.st_size else None

    def _entry(self, name: str) -> _Tensor:
        if name not in self.entries:
            raise UserError(f"{self.path}: tensor {name} is missing")
        return self.entries[name]

    def check(self) -> None:
        for name in self.entries:
            self._bytes(self.entries[name])

    def _bytes(self, t: _Tensor) -> np.ndarray:
        need = gguf_blocks.nbytes(t.qtype, math.prod(t.shape))
        end = t.offset + t.n_bytes
        if t.n_bytes != need or self._map is None or end > self._map.shape[0]:
            raise UserError(f"{self.path}: tensor {t.gguf_name!r} ({t.qtype}, shape {list(t.shape)}) needs {need} "
                            f"bytes, the file holds {max(0, min(end, self._map.shape[0] if self._map is not None else 0) - t.offset)} "
                            "(truncated or damaged file?)")
        return self._map[t.offset:end]

    def qtype(self, name: str) -> str:
        """The tensor's GGUF type (F32 for a bias the file lacks, which reads as zeros)."""
        return self._entry(name).qtype

    def raw(self, name: str, rows: int | None = None) -> torch.Tensor:
        """uint8 [rows, bytes per row]: the file's blocks in Hugging Face row order (llama.cpp's
        q/k row permutation undone on whole rows: a block never spans two rows); only the first
        `rows` rows when given, and only those read from the file."""
        t = self._entry(name)
        matrix = len(t.shape) > 1
        if not t.gguf_name:
            return torch.zeros(t.shape[0] if matrix else 1, 4 * t.shape[-1], dtype=torch.uint8)
        data = self._bytes(t)
        n = t.shape[0]  # a matrix's rows; a vector's elements, the rows its permutation moves
        order = torch.arange(n)
        if t.unpermute_heads:
            order = gguf_import.unpermute_rows(order, t.unpermute_heads)
        if rows is not None:
            order = order[:rows]
        picked = torch.from_numpy(np.ascontiguousarray(data.reshape(n, -1)[order.numpy()]))
        return picked if matrix else picked.reshape(1, -1)

    def load(self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
        """Dequantized (bitwise `gguf.quants.dequantize`), rows unpermuted, cast to dtype."""
        t = self._entry(name)
        w = gguf_blocks.dequantize(self.raw(name).reshape(-1), t.qtype, t.shape)
        return w.to(device=device, dtype=dtype, copy=True)

    def load_layer(self, index: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{index}."
        return {n[len(prefix):]: self.load(n, dtype, device) for n in self.entries if n.startswith(prefix)}

    def source_formats(self) -> dict[str, str]:
        return {name: t.qtype for name, t in self.entries.items()}

    def close(self) -> None:
        self._map = None


def tensor_head(folder: Path, name: str, nbytes: int) -> bytes:
    """The first `nbytes` of a tensor dequantized to float32: what the same model converted to a
    float32 safetensors folder holds first (so both have one fingerprint)."""
    from .config import load_config
    ckpt = GGUFCheckpoint(folder, load_config(folder))
    t = ckpt._entry(name)
    if not t.gguf_name:
        raise KeyError(name)
    rows = min(t.shape[0], max(1, math.ceil(nbytes / 4 / t.shape[-1])))
    raw = ckpt.raw(name, rows)
    ckpt.close()
    w = gguf_blocks.dequantize(raw.reshape(-1).contiguous(), t.qtype, (raw.shape[0], t.shape[-1]))
    return w.numpy().tobytes()[:nbytes]

