"""Which draft a `--draft` value names, and building the two kinds that are not plain folders.

  * a checkpoint folder: any Llama-family model with the target's tokenizer, loaded resident;
  * "self-int8" / "self-int4": the target's own decoder layers quantised (see `quant.py`),
    resident, sharing the target's embeddings, final norm and head;
  * "self-q8" / "self-q4": substitute self-drafts (SubSpec): the target's own weights for the
    layers resident on the device, an int8 / int4 substitute only for each streamed layer, and
    the target's KV cache shared with the draft (`SpeculativeDecoder` with `draft.shares_cache`):
    no draft KV memory, no draft prefill, and the draft always attends to the target's exact
    K/V of the committed text;
  * "default": the distilled draft of the embedded default target. Its decoder layers (their
    matrices as int8 with per-row scales) and final norm are committed under
    `benchmarks/drafts/smollm2-135m-instruct/` (with the command that made them); its embeddings are the target's, frozen during distillation, so the first use
    rebuilds the full folder from the two into the cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..formats.checkpoint import fingerprint, layer_shapes, open_checkpoint
from ..formats.config import ModelConfig
from ..fsutil import INSTALL_ROOT, cache_root, fsync_path, fsync_tree, remove_stale_temps
from ..runtime.model import Transformer, fuse_projections
from ..runtime.quant import (DEFAULT_GROUP_SIZE, QuantizedLinear, dequantize_int4, dequantize_int8, pack_nibbles,
                             quantize_int4, quantize_int8, quantized_bytes)

SELF_DRAFTS = {"self-int8": "int8", "self-int4": "int4"}
SUBSTITUTE_DRAFTS = {"self-q8": "int8", "self-q4": "int4"}
DEFAULT_DRAFT = INSTALL_ROOT / "benchmarks" / "drafts" / "smollm2-135m-instruct"
LAYERS_FILE = "layers.safetensors"
Q8_SUFFIX, SCALE_SUFFIX = ".int8", ".int8_scale"  # a committed int8 matrix and its per-row scales
# a committed int4 matrix: two 4-bit codes a byte, and each group's float16 scale and minimum
Q4_SUFFIX, Q4_SCALE_SUFFIX, Q4_MIN_SUFFIX = ".int4", ".int4_scale", ".int4_min"
PACKED_SUFFIXES = (Q8_SUFFIX, SCALE_SUFFIX, Q4_SUFFIX, Q4_SCALE_SUFFIX, Q4_MIN_SUFFIX)
EMBED = "model.embed_tokens.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def self_draft_scheme(draft: str | Path | None) -> str | None:
    """The quantisation of a self-draft name (full or substitute), None for any other draft."""
    if draft is None:
        return None
    return SELF_DRAFTS.get(str(draft)) or SUBSTITUTE_DRAFTS.get(str(draft))


def is_substitute_draft(draft: str | Path | None) -> bool:
    return draft is not None and str(draft) in SUBSTITUTE_DRAFTS


def substitute_layer_bytes(cfg: ModelConfig, dtype: torch.dtype, scheme: str, group_size: int) -> int:
    """Device bytes of one layer's quantised copy: every projection quantised, plus its own copy
    of the norms (a substitute for one streamed layer; a full self-draft holds one per layer)."""
    elt = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, shape in layer_shapes(cfg).items():
        if name.endswith("proj.weight"):
            total += quantized_bytes(shape[0], shape[1], scheme, group_size)
        else:
            total += shape[0] * elt
    return total


def self_draft_bytes(cfg: ModelConfig, dtype: torch.dtype, scheme: str, group_size: int) -> int:
    """Device bytes of a full self-draft: a quantised copy of every layer."""
    return cfg.num_layers * substitute_layer_bytes(cfg, dtype, scheme, group_size)


def check_group_size(cfg: ModelConfig, group_size: int) -> None:
    """Every projection's input width must be a multiple of the int4 group size."""
    if group_size < 1:
        raise UserError(f"--draft-group-size must be >= 1, got {group_size}")
    for name, shape in layer_shapes(cfg).items():
        if name.endswith("proj.weight") and shape[1] % group_size:
            raise UserError(f"--draft-group-size {group_size} does not divide the {shape[1]} inputs of {name} "
                            f"({cfg.hidden_size} hidden, {cfg.intermediate_size} intermediate); try 32 or 64")


def build_self_draft(ckpt, target: Transformer, scheme: str, group_size: int = DEFAULT_GROUP_SIZE,
                     backend: str = "auto", resident: dict | None = None) -> Transformer:
    """Quantise the target's layers one at a time, from the checkpoint's own precision (a `Checkpoint`,
    or a `GGUFCheckpoint`, whose weights come dequantized). With `resident` (a substitute draft:
    layer index -> the target's own resident weights), those layers are the target's, as they are;
    only the others are quantised, and the draft is marked to share the target's KV cache."""
    cfg = ckpt.config
    substitute, resident = resident is not None, resident or {}
    layers = []
    for i in range(cfg.num_layers):
        if i in resident:
            layers.append(resident[i])
            continue
        full = ckpt.load_layer(i, torch.float32, "cpu")

        def make(w):
            return QuantizedLinear.from_weight(w, scheme, group_size, target.dtype, target.device, backend)
        # q/k/v and gate/up as one matrix each (`model.fuse_projections`: the same outputs, fewer calls)
        layer = fuse_projections(full, make)
        for name, w in layer.items():
            if isinstance(w, torch.Tensor):
                layer[name] = make(w) if name.endswith("proj.weight") else w.to(target.device, target.dtype)
        layers.append(layer)
    shared = {EMBED: target.embed, "model.norm.weight": target.norm}
    if not cfg.tie_word_embeddings:
        shared["lm_head.weight"] = target.lm_head
    draft = Transformer(cfg, shared, layers, target.dtype, target.device)
    draft.shares_cache = substitute  # the decoder gives it the target's KV cache
    if quantized_head(target.device):
        draft.quantized_head = QuantizedLinear.from_weight(target.lm_head, "int8", group_size, target.dtype,
                                                           target.device, backend)
    return draft


def quantized_head(device: torch.device | str) -> bool:
    """Whether a self-draft computes its logits from an int8 copy of the head: on the CPU, where a
    width-1 level reads the float head whole (113 MB for SmolLM2's 49152 x 576: 9.4 ms of a 44 ms
    level on the 2-vCPU machine, 3.5 ms as int8). Not on CUDA, where the head is one fast bf16
    matmul and the draft's passes are captured as graphs."""
    return torch.device(device).type == "cpu"


def head_bytes(cfg: ModelConfig, device: torch.device | str) -> int:
    """Device bytes of a self-draft's int8 head (`quantized_head`), 0 where it has none."""
    return quantized_bytes(cfg.vocab_size, cfg.hidden_size, "int8", DEFAULT_GROUP_SIZE) if quantized_head(device) else 0


# ---- the embedded default pair's distilled draft ------------------------------------------------

def default_draft_dir(target_folder: Path, progress: bool = True) -> Path:
    """The full folder of the default draft, rebuilt once into the cache from the committed layers
    and the default target's embeddings."""
    layers_path = DEFAULT_DRAFT / LAYERS_FILE
    try:
        meta = json.loads((DEFAULT_DRAFT / "provenance.json").read_text())
        digest = hashlib.sha256(layers_path.read_bytes()).hexdigest()[:12]
    except (OSError, ValueError) as e:
        raise UserError(f"the default draft's files in {DEFAULT_DRAFT} are missing or damaged ({e})") from None
    root = cache_root() / "drafts"
    # keyed by the target too: another target gets its own build, where the embeddings check runs
    folder = root / f"{DEFAULT_DRAFT.name}-{digest}-{fingerprint(target_folder) or 'unreadable'}"
    if (folder / "model.safetensors").exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root, f".{DEFAULT_DRAFT.name}-*.tmp-*")
    tensors = unpack_layers(load_file(str(layers_path)))
    dtype = next(iter(tensors.values())).dtype
    from ..formats.config import load_config
    cfg = load_config(target_folder)
    ckpt = open_checkpoint(target_folder, cfg)
    try:
        embed = ckpt.load(EMBED, torch.float32).to(dtype)
    finally:
        ckpt.close()
    if _digest(embed) != meta["embeddings_sha256"]:
        raise UserError(f"the default draft was distilled for another target: the embeddings of {target_folder} "
                        "differ from the ones it was trained with")
    tensors[EMBED] = embed
    tmp = root / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(DEFAULT_DRAFT / "config.json", tmp / "config.json")
    for name in TOKENIZER_FILES:
        if (target_folder / name).exists():
            shutil.copyfile(target_folder / name, tmp / name)
    fsync_tree(tmp)  # the folder's bytes on the disk before its name is
    try:
        os.replace(tmp, folder)
        fsync_path(root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def pack_default_draft(distilled: Path, dest: Path = DEFAULT_DRAFT, weights: str = "int8",
                       group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """Write the committed form of a distilled draft: everything but the (target's) embeddings.
    Only a draft at the target's hidden size has the target's (frozen) embeddings. With
    weights="int8" each projection matrix is stored as int8 with one scale per output channel
    (`quant.quantize_int8`, error at most max|row|/254 per weight); with "int4", as 4-bit codes
    in groups of `group_size` inputs with a float16 scale and minimum per group
    (`quant.quantize_int4`, error at most (max - min)/30 per weight before the float16 rounding
    of scale and minimum: 0.56 bytes a weight, so about 12 layers of SmolLM2-135M fit the 25 MB a
    committed draft may take, against 7 in int8). Matrices are dequantised to the draft's dtype
    when the folder is rebuilt; "same" stores them as they are."""
    if weights not in ("int8", "int4", "same"):
        raise ValueError(f"weights must be 'int8', 'int4' or 'same', got {weights!r}")
    report = json.loads((distilled / "distill.json").read_text())
    if report["options"].get("hidden") not in (None, json.loads((Path(report["target"]) / "config.json").read_text())
                                               ["hidden_size"]):
        raise UserError(f"{distilled} was distilled at another hidden size: its embeddings are its own")
    tensors = load_file(str(distilled / "model.safetensors"))
    embed = tensors.pop(EMBED)
    if weights != "same":
        packed = {}
        for name, w in tensors.items():
            if w.dim() != 2:
                packed[name] = w
            elif weights == "int8":
                packed[name + Q8_SUFFIX], packed[name + SCALE_SUFFIX] = quantize_int8(w)
            else:
                if w.shape[1] % group_size:
                    raise UserError(f"{distilled}: {name} has {w.shape[1]} inputs, not a multiple of the int4 "
                                    f"group size {group_size}")
                q, scale, lo = quantize_int4(w, group_size)
                packed[name + Q4_SUFFIX] = pack_nibbles(q)
                packed[name + Q4_SCALE_SUFFIX], packed[name + Q4_MIN_SUFFIX] = scale.half(), lo.half()
        tensors = packed
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / LAYERS_FILE), metadata={"format": "pt"})
    shutil.copyfile(distilled / "config.json", dest / "config.json")
    shutil.copyfile(distilled / "distill.json", dest / "distill.json")
    provenance = {"embeddings_sha256": _digest(embed), "weights": weights}
    if weights == "int4":
        provenance["group_size"] = group_size
    (dest / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")


def unpack_layers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The committed layers with int8 / int4 matrices dequantised to the dtype of the other tensors."""
    dtype = next((w.dtype for n, w in tensors.items() if not n.endswith(PACKED_SUFFIXES)), torch.float32)
    out = {}
    for name, w in tensors.items():
        if name.endswith(Q8_SUFFIX):
            base = name[:-len(Q8_SUFFIX)]
            out[base] = dequantize_int8(w, tensors[base + SCALE_SUFFIX]).to(dtype)
        elif name.endswith(Q4_SUFFIX):
            base = name[:-len(Q4_SUFFIX)]
            out[base] = dequantize_int4(w, tensors[base + Q4_SCALE_SUFFIX], tensors[base + Q4_MIN_SUFFIX]).to(dtype)
        elif not name.endswith(PACKED_SUFFIXES):
            out[name] = w
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
