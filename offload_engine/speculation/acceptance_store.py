"""Measured acceptance vectors kept beside the hardware profiles (`hw_profiles/acceptance/`).

A stored vector is the JSON the `acceptance` command writes; it names the pair it was measured
on by fingerprints (`formats.checkpoint.fingerprint`), so it is found again whatever folder the
models sit in:
  * the target: sha256 of its config.json (parsed and re-dumped with sorted keys), its
    tokenizer.json, and the first MiB of its embeddings and of its first layer's query
    projection (this tells a fine-tune, LoRA-merged or not, from its base, which share config
    and tokenizer) — cheap even for a 70B model;
  * the draft: "self-int8", "self-int4-g<group size>", or "model:<fingerprint>" of its folder.

`--tree sequoia` without `--acceptance` uses the stored vector of its (target, draft) pair whose
temperature is nearest the generation's, and falls back to a generic vector when none is stored.
"""

from __future__ import annotations

import json
from pathlib import Path

from sequoia_trees.acceptance import AcceptanceVector

from ..errors import UserError
from ..formats.checkpoint import fingerprint
from ..fsutil import INSTALL_ROOT, cache_root
from .drafts import is_substitute_draft, self_draft_scheme

STORE_DIR = INSTALL_ROOT / "hw_profiles" / "acceptance"


def draft_key(draft: str | Path, draft_folder: Path | None, group_size: int, resident: int = 0) -> str | None:
    """The draft's name in the vectors' and profiles' keys. A substitute self-draft is another
    draft with each layer the plan keeps resident (the target's own, where the copy would be
    quantised): `resident` of them adds -r<resident> (self-q8-r12); none keeps the plain name."""
    scheme = self_draft_scheme(draft)
    if scheme is not None:  # self-int8, self-int4-g64, self-q8, self-q4-g64, self-q8-r12
        return (str(draft) + (f"-g{group_size}" if scheme == "int4" else "")
                + (f"-r{resident}" if resident and is_substitute_draft(draft) else ""))
    fp = fingerprint(draft_folder)
    return "model:" + fp if fp is not None else None


def read_vector(path: str | Path) -> tuple[AcceptanceVector, dict]:
    """An acceptance vector file (`{"acceptance": [p_1, p_2, ...], ...}`, as the acceptance command
    writes it) and its whole JSON object; anything else is a UserError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UserError(f"{path}: not an acceptance vector ({e})") from None
    return _vector(data, path), data


def _vector(data, path: Path) -> AcceptanceVector:
    probs = data.get("acceptance") if isinstance(data, dict) else None
    if not isinstance(probs, list) or not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in probs):
        raise UserError(f'{path}: not an acceptance vector (expected {{"acceptance": [p_1, p_2, ...]}} with '
                        "numbers)")
    try:
        return AcceptanceVector(tuple(float(p) for p in probs))
    except (ValueError, OverflowError) as e:  # OverflowError: an integer too large for a float
        raise UserError(f"{path}: not an acceptance vector ({e})") from None


# the version of `--tree auto`'s quick measurement (`measure.measure_and_cache`), in each vector
# it caches: a cached vector of another version (or of none: the one-level tree's 48 steps,
# before 2026-12-05) is not used, and the pair is measured again
MEASUREMENT = 2


def stored_vectors(target_fp: str | None, dkey: str | None, store: Path | None = None,
                   measurement: int | None = None) -> dict[float, tuple[AcceptanceVector, Path]]:
    """Every stored vector of the pair, by temperature (with `measurement`: those measured by
    that version of the quick measurement alone)."""
    store = store if store is not None else STORE_DIR
    found: dict[float, tuple[AcceptanceVector, Path]] = {}
    if target_fp is None or dkey is None:
        return found
    for path in sorted(store.glob("*.json")) if store.is_dir() else []:
        try:
            vector, data = read_vector(path)
        except UserError:
            continue  # not a stored vector
        t = data.get("temperature")  # a number a float holds (not NaN, not a 400-digit integer)
        if (data.get("target_fingerprint") == target_fp and data.get("draft_key") == dkey
                and isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 1e300
                and (measurement is None or data.get("measurement") == measurement)):
            found[float(t)] = (vector, path)
    return found


def nearest(vectors: dict[float, tuple[AcceptanceVector, Path]], temperature: float):
    """(vector, path, its temperature) nearest `temperature`; ties go to the lower one."""
    t = min(vectors, key=lambda k: (abs(k - temperature), k))
    vec, path = vectors[t]
    return vec, path, t


def acceptance_cache_dir() -> Path:
    """Where vectors measured on this machine (by `--tree auto`) are cached."""
    return cache_root() / "acceptance"


def known_vectors(target_fp: str | None, dkey: str | None) -> dict:
    """The pair's vectors by temperature, stored in the repo or cached (the repo's win a tie)."""
    found = stored_vectors(target_fp, dkey)
    for t, v in stored_vectors(target_fp, dkey, acceptance_cache_dir(), MEASUREMENT).items():
        found.setdefault(t, v)
    return found
