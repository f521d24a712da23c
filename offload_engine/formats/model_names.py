"""Models by name, found where people already keep them; nothing here reaches the network.

    org/name[@revision]        a Hugging Face repository in the local hub cache (HF_HUB_CACHE, else
                               HF_HOME/hub, else ~/.cache/huggingface/hub), through huggingface_hub's
                               cache API with local files only
    ollama:NAME[:TAG]          a model pulled by Ollama (OLLAMA_MODELS, else ~/.ollama/models): its
                               manifest names the GGUF blob of its weights (default tag `latest`;
                               NAME may be `user/name` or `host/namespace/name`)

A snapshot folder is a checkpoint as it is (its files are symlinks into the cache's blobs); a
snapshot that holds GGUF files and no config.json gives its one GGUF file. An Ollama blob is a
GGUF file with no extension, read in its own block formats through a sidecar folder like any
other GGUF file (formats/gguf_model.py). A name that is not found is a UserError listing the
close matches that are there.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

OLLAMA_PREFIX = "ollama:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
GGUF_MAGIC = b"GGUF"
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")
_HF_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")  # no "..", no "//"


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub itself would use, read from the environment now."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def is_model_name(value: str) -> bool:
    """True when `value` is a name this module resolves (and not a path that exists)."""
    value = str(value)
    if value.startswith(OLLAMA_PREFIX):
        return True
    return bool(_HF_ID.match(value)) and not Path(value).expanduser().exists()


def resolve_name(value: str) -> Path:
    """The local file or folder a model name stands for (a GGUF file, or a checkpoint folder)."""
    value = str(value)
    if value.startswith(OLLAMA_PREFIX):
        return resolve_ollama(value[len(OLLAMA_PREFIX):])
    return resolve_hf(value)


# --- Hugging Face cache ---------------------------------------------------------------------

@dataclass(frozen=True)
class HFEntry:
    repo_id: str
    revision: str  # the commit hash
    refs: tuple[str, ...]  # branch or tag names pointing at it ("main", ...)
    snapshot: Path
    problem: str = ""  # why the cache scan found the repository unreadable (a broken link...)


def hf_entries(cache: Path | None = None) -> list[HFEntry]:
    """Every model snapshot in the hub cache (datasets and spaces left out), and each model
    repository the scan found corrupted (one entry with its `problem`); [] when none."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    cache = cache or hf_cache_dir()
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    except OSError as e:
        raise UserError(f"Hugging Face cache {cache}: cannot be read ({e.strerror or e})") from None
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: (not r.refs, r.commit_hash)):
            out.append(HFEntry(repo.repo_id, rev.commit_hash, tuple(sorted(rev.refs)), Path(rev.snapshot_path)))
    for warning in info.warnings:  # e.g. "Blob missing (broken symlink): ..."
        found = re.search(r"models--([^/\\]+)", str(warning))
        if found:
            out.append(HFEntry(found.group(1).replace("--", "/"), "", (), Path(), str(warning)))
    return out


def resolve_hf(value: str) -> Path:
    if not _HF_ID.match(value):
        raise UserError(f"{value!r}: not a path that exists, 'default', a Hugging Face id (org/name[@revision]) "
                        "or ollama:NAME[:TAG]")
    repo_id, _, revision = value.partition("@")
    if revision and (".." in revision or not _HF_REVISION.match(revision)):
        raise UserError(f"{value}: {revision!r} is not a revision (a branch, tag or full commit hash)")
    cache = hf_cache_dir()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:  # huggingface_hub >= 1.x: a snapshot known to lack files of its repo (--include/--exclude)
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # older versions never raise it
        IncompleteSnapshotError = ()  # noqa: N806
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache,
                                          local_files_only=True))
    except IncompleteSnapshotError as e:
        # a partial download (`huggingface-cli download --include/--exclude`): what it holds may be all
        # a model needs (the safetensors without the original/ weights, one GGUF of several quants);
        # checked_snapshot and the loader name anything missing
        snapshot = Path(e.snapshot_path)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        found = [e.repo_id for e in hf_entries(cache)]
        what = f"revision {revision!r} of {repo_id}" if revision and repo_id in found else repo_id
        raise UserError(f"{value}: no such folder, and {what} is not in the Hugging Face cache {cache} (nothing "
                        f"is downloaded: fetch it first, e.g. `huggingface-cli download {repo_id}`)"
                        + _close(repo_id, found)) from None
    return checked_snapshot(snapshot, value)


def checked_snapshot(snapshot: Path, name: str) -> Path:
    """A snapshot folder that can be loaded: its links resolve, and it is a checkpoint or one GGUF."""
    if not snapshot.is_dir():
        raise UserError(f"{name}: snapshot folder {snapshot} is missing from the cache")
    broken = sorted(p.name for p in snapshot.rglob("*") if p.is_symlink() and not p.exists())
    if broken:
        raise UserError(f"{name}: {len(broken)} file(s) of snapshot {snapshot} point at missing blobs "
                        f"({', '.join(broken[:5])}): the download was interrupted or the cache pruned; "
                        "download it again")
    config = (snapshot / "config.json").is_file()
    if config and any(snapshot.glob("*.safetensors")):
        return snapshot
    ggufs = sorted(snapshot.rglob("*.gguf"))  # (GGUF repos often ship a config.json too)
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        listed = ", ".join(str(p.relative_to(snapshot)) for p in ggufs[:8])
        raise UserError(f"{name}: holds {len(ggufs)} GGUF files ({listed}); give the path of the one to load, "
                        f"e.g. {ggufs[0]}")
    if config:
        raise UserError(f"{name}: snapshot {snapshot} has a config.json but no .safetensors weights (pickled "
                        "weights are never loaded); download its safetensors files")
    raise UserError(f"{name}: snapshot {snapshot} has neither a config.json nor a GGUF file: not a model "
                    "this runtime can load")


# --- Ollama ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class OllamaEntry:
    name: str  # as `ollama list` shows it: "llama3.1:70b", "user/model:tag"
    manifest: Path


def parse_ollama(value: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) of NAME[:TAG], as Ollama names its manifests."""
    if not value or value.startswith(":"):
        raise UserError(f"ollama:{value}: give a model name, e.g. ollama:llama3.1:70b")
    name, tag = value, "latest"
    last = value.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = value.rsplit(":", 1)
    parts = name.split("/")
    if len(parts) == 1:
        host, ns, model = OLLAMA_REGISTRY, "library", parts[0]
    elif len(parts) == 2:
        host, ns, model = OLLAMA_REGISTRY, parts[0], parts[1]
    elif len(parts) == 3:
        host, ns, model = parts
    else:
        raise UserError(f"ollama:{value}: not an Ollama model name (NAME[:TAG], user/NAME[:TAG] or "
                        "host/namespace/NAME[:TAG])")
    if not all(p and p not in (".", "..") for p in (host, ns, model, tag)):
        raise UserError(f"ollama:{value}: not an Ollama model name")
    return host, ns, model, tag


def ollama_entries(root: Path | None = None) -> list[OllamaEntry]:
    root = root or ollama_dir()
    manifests = root / "manifests"
    out = []
    if not manifests.is_dir():
        return out
    for path in sorted(manifests.glob("*/*/*/*")):
        if not path.is_file():
            continue
        host, ns, model, tag = path.relative_to(manifests).parts
        short = model if (host, ns) == (OLLAMA_REGISTRY, "library") else \
            f"{ns}/{model}" if host == OLLAMA_REGISTRY else f"{host}/{ns}/{model}"
        out.append(OllamaEntry(f"{short}:{tag}", path))
    return out


def resolve_ollama(value: str) -> Path:
    root = ollama_dir()
    host, ns, model, tag = parse_ollama(value)
    manifest = root / "manifests" / host / ns / model / tag
    if not manifest.is_file():
        found = [e.name for e in ollama_entries(root)]
        raise UserError(f"ollama:{value} is not in Ollama's models folder {root} (nothing is downloaded: "
                        f"`ollama pull {value}` first)" + _close(value, found, prefix=OLLAMA_PREFIX))
    return ollama_blob(manifest, f"ollama:{value}", root)


def ollama_blob(manifest: Path, name: str, root: Path) -> Path:
    """The GGUF blob an Ollama manifest names for its weights, checked."""
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
        layers = doc["layers"]
        if not isinstance(layers, list):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise UserError(f"{name}: manifest {manifest} is not an Ollama manifest (no list of layers)") from None
    models = [layer for layer in layers if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if len(models) != 1:
        kinds = ", ".join(sorted({str(layer.get("mediaType")) for layer in layers if isinstance(layer, dict)}))
        raise UserError(f"{name}: manifest {manifest} has {len(models)} model layers ({OLLAMA_MODEL_LAYER}); "
                        f"its layers: {kinds or 'none'}")
    digest = str(models[0].get("digest", ""))
    if not re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
        raise UserError(f"{name}: manifest {manifest}: model layer digest {digest!r} is not sha256:<64 hex>")
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        legacy = root / "blobs" / digest  # older Ollama versions kept the colon
        if legacy.is_file():
            blob = legacy
        else:
            raise UserError(f"{name}: the weights' blob {blob} named by {manifest} is missing: the pull was "
                            f"interrupted or the blob pruned; `ollama pull` it again")
    with open(blob, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UserError(f"{name}: blob {blob} is not a GGUF file (it starts with {magic!r}); only GGUF "
                        "weights can be loaded from Ollama")
    return blob


def _close(name: str, found: list[str], prefix: str = "") -> str:
    if not found:
        return "; the cache holds no models"
    lower = {f.lower(): f for f in found}
    key = name.lower()
    stem = key.split("@")[0].split("/")[-1].split(":")[0]
    near = difflib.get_close_matches(key, list(lower), n=5, cutoff=0.5)
    near += [f for f in lower if stem and stem in f and f not in near]
    near = [lower[n] for n in near][:5]
    if near:
        return "; close matches: " + ", ".join(prefix + n for n in near)
    return f"; it holds {len(found)} other model(s), e.g. " + ", ".join(prefix + f for f in found[:3])
