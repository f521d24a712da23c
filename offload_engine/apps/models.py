"""`sequoia-offload models`: every model this machine can run, where it already is.

Sources: the embedded default, the Hugging Face hub cache, Ollama's models, and folders given
with `--search DIR` (checkpoint folders and .gguf files, three levels down). For each usable
model: its family, parameters, format and bits per weight, bytes on disk, and, for this machine's
budgets, where its layers would live (device / RAM / disk). With a GPU (this machine's when its
spec sheet is known, or `--gpu NAME`) the simulator predicts s/token plain and with the tree it
would choose, paired with the largest listed model that shares its tokenizer and has at most a
quarter of its parameters (the pairs that can speculate together). Nothing is downloaded; GGUF
files get their metadata sidecar once (as loading them would).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UserError
from ..formats import model_names
from ..formats.gguf_model import SIDECAR_FILE, is_sidecar
from ..planning.draft_choice import DRAFT_RATIO, parameters, vocab_digest

# torch.cuda.get_device_name() (lowercased) -> the shipped spec sheet (`gpu_names()`)
GPU_PATTERNS = ((r"rtx 4090", "rtx4090"), (r"rtx 3090", "rtx3090"), (r"rtx 4080", "rtx4080"),
                (r"\bl40s?\b", "l40"), (r"a100", "a100-40gb"), (r"h100.*pcie", "h100-pcie"))
SEARCH_DEPTH = 3


@dataclass
class ModelRow:
    name: str  # what to give --target / --draft
    source: str  # default, hf, ollama, folder
    path: str = ""
    family: str = ""
    params: int = 0
    format: str = ""
    bits_per_weight: float = 0.0
    disk_bytes: int = 0
    layers: dict = field(default_factory=dict)  # {"device": n, "ram": n, "disk": n}
    plain_s_per_token: float | None = None
    tree_s_per_token: float | None = None
    tree: str = ""
    draft: str = ""  # the draft the prediction pairs it with
    drafts: list = field(default_factory=list)  # every listed model that can draft for it
    error: str = ""
    tokenizer: str = ""  # a digest of the vocabulary: equal digests can speculate together
    _cfg: object = None
    _folder: Path | None = None
    _precision: str = "fp16"
    _draft_row: "ModelRow | None" = None  # what the prediction pairs it with


def candidates(search: list[Path]) -> list[tuple[str, str]]:
    """(name, source) of everything that may be a model, cheapest checks only."""
    out: list[tuple[str, str]] = [("default", "default")]
    for e in model_names.hf_entries():
        if e.problem:  # listed, and its row says why it cannot be loaded
            out.append((e.repo_id, "hf"))
            continue
        ref = "" if "main" in e.refs else "@" + (e.refs[0] if e.refs else e.revision)
        snap = e.snapshot
        ggufs = sorted(snap.rglob("*.gguf"))
        checkpoint = ((snap / "config.json").exists() or (snap / "config.json").is_symlink()) and \
            any(snap.glob("*.safetensors"))
        if checkpoint or len(ggufs) <= 1:  # the name (its errors, if any, in its row)
            out.append((e.repo_id + ref, "hf"))
        else:  # several quantizations of one model: each file is a model
            out += [(str(p), "hf") for p in ggufs]
    out += [(model_names.OLLAMA_PREFIX + e.name, "ollama") for e in model_names.ollama_entries()]
    for root in search:
        root = Path(root).expanduser()
        if not root.is_dir():
            raise UserError(f"--search {root}: not a folder")
        out += [(str(p), "folder") for p in _walk(root, SEARCH_DEPTH)]
    return list(dict.fromkeys(out))


def _walk(folder: Path, depth: int) -> list[Path]:
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return [folder]
    found = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if depth > 0:
        try:
            subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            subs = []
        for sub in subs:
            found += _walk(sub, depth - 1)
    return found


def inspect(name: str, source: str) -> ModelRow:
    """One row: what the model is and what it takes (its error when it cannot be used)."""
    from ..engine import resolve_target
    from ..formats.config import load_config
    row = ModelRow(name, source)
    try:
        folder = resolve_target(name, progress=False)
        cfg = load_config(folder)
    except UserError as e:
        row.error = str(e)
        return row
    row._cfg, row._folder = cfg, folder
    row.family = cfg.model_type
    row.params = parameters(cfg)
    if is_sidecar(folder):
        meta = json.loads((folder / SIDECAR_FILE).read_text(encoding="utf-8"))
        row.path = meta["file"]
        row.disk_bytes = int(meta["size"])
        by_type = Counter()
        for t in meta["tensors"]:
            by_type[t[4]] += int(t[6])
        main = by_type.most_common(1)[0][0] if by_type else "?"
        row.format = f"GGUF {main}"
        row.bits_per_weight = 8 * sum(by_type.values()) / max(row.params, 1)
        row._precision = main.lower() if main.lower() in _gguf_formats() else "fp16"
    else:
        row.path = str(folder)
        files = sorted({p.resolve() for p in folder.glob("*.safetensors")})
        row.disk_bytes = sum(p.stat().st_size for p in files)
        dtype = _safetensors_dtype(files)
        row.format = f"safetensors {dtype}"
        row.bits_per_weight = 8 * row.disk_bytes / max(row.params, 1)
    row.tokenizer = vocab_digest(folder)
    return row


def _gguf_formats() -> tuple[str, ...]:
    from ..planning.simulator import GGUF_FORMATS
    return GGUF_FORMATS


def _safetensors_dtype(files: list[Path]) -> str:
    """The dtype holding most of the weights, read from the files' headers."""
    count: Counter = Counter()
    sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1}
    for path in files:
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            continue
        for key, t in header.items():
            if key != "__metadata__" and isinstance(t, dict):
                start, end = t.get("data_offsets", (0, 0))
                count[t.get("dtype", "?")] += end - start
    return count.most_common(1)[0][0].lower() if count else "?"


def pair_drafts(rows: list[ModelRow]) -> None:
    """Every usable row's possible drafts: same vocabulary (tokens and embedding rows), at most
    DRAFT_RATIO of its parameters."""
    usable = [r for r in rows if not r.error]
    for r in usable:
        small = [d for d in usable if d is not r and d.tokenizer and d.tokenizer == r.tokenizer
                 and d._cfg.vocab_size == r._cfg.vocab_size  # the engine refuses another embedding size
                 and d.params <= DRAFT_RATIO * r.params]
        small.sort(key=lambda d: -d.params)
        r.drafts = [d.name for d in small]
        r._draft_row = small[0] if small else None


def place_and_predict(rows: list[ModelRow], gpu: str | None, ram: int, vram: int | None,
                      ram_given: bool = False) -> str:
    """Fill layers and predictions; returns what the predictions assume, in words. Without a
    spec sheet the layers are placed by this machine's planner, under --ram/--vram when given."""
    from ..planning import simulator
    from ..planning.hw_profile import load_gpu_spec
    spec = load_gpu_spec(gpu) if gpu else None
    for r in rows:
        if r.error:
            continue
        if spec is None:
            _place_here(r, ram if ram_given else None, vram)
            continue
        draft = r._draft_row
        try:
            plain = simulator.simulate(spec, ram, r._cfg, None, r._precision, vram=vram)
        except UserError as e:
            r.error = f"does not fit: {e}"
            continue
        r.plain_s_per_token = plain.plain_seconds_per_token
        p = plain.plan
        r.layers = {"device": len(p.resident_layers), "ram": len(p.ram_layers), "disk": len(p.disk_layers)}
        if draft is not None:
            try:  # a draft that does not fit beside it leaves the plain prediction standing
                sim = simulator.simulate(spec, ram, r._cfg, draft._cfg, r._precision, vram=vram,
                                         draft_precision=draft._precision)
            except UserError as e:
                r.tree = f"not with {r.drafts[0]}: {e}"
                continue
            r.tree_s_per_token = sim.choice.seconds_per_token
            r.tree = f"({sim.choice.budget},{sim.choice.depth})"
            r.draft = r.drafts[0]
    if spec is None:
        return ("no GPU spec sheet for this machine: layers as the planner would place them here; give "
                "--gpu NAME (rtx4090, rtx3090, l40, ...) for predicted speeds")
    return (f"predicted on {spec.name} with {ram / 2**30:.0f} GiB RAM by the simulator (spec-sheet model, the "
            "Sequoia paper's Llama3-70B/8B acceptance; `sequoia-offload simulate` explains the assumptions)")


def _place_here(r: ModelRow, ram: int | None, vram: int | None) -> None:
    from ..engine import plan_only
    try:
        plan = plan_only(r._folder, ram=ram, vram=vram)[0]
    except UserError as e:
        r.error = f"does not fit: {e}"
        return
    r.layers = {"device": len(plan.resident_layers), "ram": len(plan.ram_layers), "disk": len(plan.disk_layers)}


def local_gpu() -> str | None:
    """The spec-sheet name of this machine's GPU, when there is one and its sheet is shipped."""
    import torch
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).lower()
    if "laptop" in name or "mobile" in name:  # other memory and clocks than the desktop part's sheet
        return None
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    for pattern, sheet in GPU_PATTERNS:
        if re.search(pattern, name) and (sheet != "a100-40gb" or memory_gb < 60):
            return sheet
    return None


def list_models(search: list[Path], gpu: str | None, ram: int, vram: int | None,
                ram_given: bool = False) -> tuple[list[ModelRow], str]:
    rows = [inspect(name, source) for name, source in candidates(search)]
    pair_drafts(rows)
    default = next((r for r in rows if r.name == "default" and not r.error), None)
    if default is not None:  # the embedded pair: its distilled draft first
        from ..formats.config import load_config
        from ..speculation.drafts import default_draft_dir
        try:
            folder = default_draft_dir(default._folder, progress=False)
            default._draft_row = ModelRow("default", "default-draft", _cfg=load_config(folder))
            default.drafts.insert(0, "default")
        except UserError:
            pass
    return rows, place_and_predict(rows, gpu, ram, vram, ram_given)


def as_json(rows: list[ModelRow], note: str) -> str:
    items = [{k: v for k, v in asdict(r).items() if not k.startswith("_")} for r in rows]
    return json.dumps({"note": note, "models": items}, indent=2)


def table(rows: list[ModelRow], note: str) -> str:
    from ..runtime.placement import fmt_bytes
    usable = [r for r in rows if not r.error]
    head = ("NAME", "FAMILY", "PARAMS", "FORMAT", "BITS/W", "DISK", "LAYERS dev/RAM/disk", "PLAIN s/tok",
            "TREE s/tok", "DRAFTS")
    body = []
    for r in usable:
        layers = "/".join(str(r.layers.get(k, "-")) for k in ("device", "ram", "disk")) if r.layers else "-"
        tree = f"{r.tree_s_per_token:.3f} {r.tree} with {r.draft}" if r.tree_s_per_token is not None else "-"
        body.append((r.name, r.family, _count(r.params), r.format, f"{r.bits_per_weight:.1f}",
                     fmt_bytes(r.disk_bytes), layers,
                     f"{r.plain_s_per_token:.3f}" if r.plain_s_per_token is not None else "-", tree,
                     ", ".join(r.drafts) or "-"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body)]
    if not usable:
        lines = ["no usable model found (the default is missing, and neither the Hugging Face cache, Ollama's "
                 "models nor --search folders hold one)"]
    lines += ["", note, "Any target can also draft for itself: --draft self-int8 or self-int4."]
    bad = [r for r in rows if r.error]
    if bad:
        lines += ["", "not usable:"] + [f"  {r.name}: {r.error}" for r in bad]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else str(n)
