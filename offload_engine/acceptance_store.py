"""Measured acceptance vectors kept beside the hardware profiles (`hw_profiles/acceptance/`).

A stored vector is the JSON the `acceptance` command writes; it names the pair it was measured
on by fingerprints, so it is found again whatever folder the models sit in:
  * the target: sha256 of its config.json (parsed and re-dumped with sorted keys), its
    tokenizer.json and the first MiB of its first weights file's tensor data (this tells a
    fine-tune from its base, which share config and tokenizer) — cheap even for a 70B model;
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

STORE_DIR = Path(__file__).resolve().parent.parent / "hw_profiles" / "acceptance"
_SAMPLE_BYTES = 1 << 20


def fingerprint(folder: Path) -> str:
    folder = Path(folder)
    h = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    h.update(json.dumps(config, sort_keys=True).encode())
    tok = folder / "tokenizer.json"
    if tok.exists():
        h.update(tok.read_bytes())
    index = folder / "model.safetensors.index.json"
    if index.exists():
        first = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
        weights = folder / first
    else:
        weights = folder / "model.safetensors"
    with open(weights, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header_len)
        h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def draft_key(draft: str | Path, draft_folder: Path | None, group_size: int) -> str:
    scheme = self_draft_scheme(draft)
    if scheme == "int8":
        return "self-int8"
    if scheme == "int4":
        return f"self-int4-g{group_size}"
    return "model:" + fingerprint(draft_folder)


def stored_vectors(target_fp: str, dkey: str, store: Path | None = None) -> dict[float, tuple[AcceptanceVector, Path]]:
    """Every stored vector of the pair, by temperature."""
    store = store if store is not None else STORE_DIR
    found: dict[float, tuple[AcceptanceVector, Path]] = {}
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
