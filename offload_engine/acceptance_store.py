"""Measured acceptance vectors kept beside the hardware profiles (`hw_profiles/acceptance/`).

A stored vector is the JSON the `acceptance` command writes; it names the pair it was measured
on by fingerprints, so it is found again whatever folder the models sit in:
  * the target: sha256 of its config.json (parsed and re-dumped with sorted keys), its
    tokenizer.json, and the first MiB of its embeddings and of its first layer's query
    projection (this tells a fine-tune, LoRA-merged or not, from its base, which share config
    and tokenizer) — cheap even for a 70B model;
  * the draft: "self-int8", "self-int4-g<group size>", or "model:<fingerprint>" of its folder.

`--tree sequoia` without `--acceptance` uses the stored vector of its (target, draft) pair whose
temperature is nearest the generation's, and falls back to a generic vector when none is stored.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from sequoia_trees.acceptance import AcceptanceVector

from .drafts import self_draft_scheme
from .errors import UserError

STORE_DIR = Path(__file__).resolve().parent.parent / "hw_profiles" / "acceptance"
_SAMPLE_BYTES = 1 << 20
# the embeddings, and the first layer's query projection (which a LoRA merge or fine-tune changes
# even when it leaves the embeddings alone)
_SAMPLED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")


def fingerprint(folder: Path) -> str | None:
    """16 hex digits naming a checkpoint's weights, or None when the folder cannot be read (then
    no stored vector matches it; loading the model reports the real problem)."""
    from .checkpoint import Checkpoint
    from .config import load_config
    folder = Path(folder)
    try:
        h = hashlib.sha256()
        h.update(json.dumps(json.loads((folder / "config.json").read_text(encoding="utf-8")), sort_keys=True).encode())
        tok = folder / "tokenizer.json"
        if tok.exists():
            h.update(tok.read_bytes())
        file_of = Checkpoint(folder, load_config(folder)).file_of
        for name in _SAMPLED:
            if name in file_of:
                h.update(name.encode())
                h.update(_tensor_head(file_of[name], name))
        return h.hexdigest()[:16]
    except (OSError, ValueError, KeyError, TypeError, struct.error, UserError):
        return None


def _tensor_head(path: Path, name: str) -> bytes:
    """The first MiB of one tensor's bytes, found through the safetensors header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        start, end = header[name]["data_offsets"]
        f.seek(8 + header_len + start)
        return f.read(min(_SAMPLE_BYTES, end - start))


def draft_key(draft: str | Path, draft_folder: Path | None, group_size: int) -> str | None:
    scheme = self_draft_scheme(draft)
    if scheme == "int8":
        return "self-int8"
    if scheme == "int4":
        return f"self-int4-g{group_size}"
    fp = fingerprint(draft_folder)
    return "model:" + fp if fp is not None else None


def stored_vectors(target_fp: str | None, dkey: str | None,
                   store: Path | None = None) -> dict[float, tuple[AcceptanceVector, Path]]:
    """Every stored vector of the pair, by temperature."""
    store = store if store is not None else STORE_DIR
    found: dict[float, tuple[AcceptanceVector, Path]] = {}
    if target_fp is None or dkey is None:
        return found
    for path in sorted(store.glob("*.json")) if store.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("target_fingerprint") == target_fp and data.get("draft_key") == dkey:
                found[float(data["temperature"])] = (AcceptanceVector(tuple(data["acceptance"])), path)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a stored vector
    return found


def nearest(vectors: dict[float, tuple[AcceptanceVector, Path]], temperature: float):
    """(vector, path, its temperature) nearest `temperature`; ties go to the lower one."""
    t = min(vectors, key=lambda k: (abs(k - temperature), k))
    vec, path = vectors[t]
    return vec, path, t
