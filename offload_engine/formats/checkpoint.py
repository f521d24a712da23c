"""Hugging Face safetensors checkpoints: single file or sharded (model.safetensors.index.json).

Tensors are read one at a time through safetensors' memory map, cast to the compute dtype and
checked against the shapes the config implies, so nothing is loaded twice and a checkpoint that
disagrees with its config is refused with the tensor's name.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import UserError
from .config import ModelConfig, load_config, read_json_object

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Per-layer tensor names, relative to "model.layers.{i}.".
LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's tensors, keyed by the name relative to the layer."""
    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    if cfg.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,)})
    if cfg.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if cfg.mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (h,)})
    return shapes


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors outside the decoder layers (lm_head only when untied)."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
              "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


class Checkpoint:
    """Read-only view of a safetensors checkpoint folder: which file holds which tensor."""

    def __init__(self, folder: str | Path, config: ModelConfig):
        self.folder = Path(folder)
        self.config = config
        self.file_of: dict[str, Path] = self._index()
        self._handles: dict[Path, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = self._expected_shapes()

    def _index(self) -> dict[str, Path]:
        index = self.folder / INDEX_NAME
        single = self.folder / SINGLE_NAME
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{index}: not a valid safetensors index (no weight_map)")
            for name, fname in weight_map.items():  # a file of this folder: no path, nothing above it
                if not isinstance(fname, str) or fname in ("", ".", "..") or Path(fname).name != fname:
                    raise UserError(f"{index}: weight_map gives {name!r} the file {fname!r}, not a file name "
                                    f"in {self.folder}")
            file_of = {name: self.folder / fname for name, fname in weight_map.items()}
            for path in sorted(set(file_of.values())):
                if not path.is_file():
                    raise UserError(f"{index}: shard {path.name} is missing from {self.folder}")
            return file_of
        if single.is_file():
            with self._open(single) as handle:
                return {name: single for name in handle.keys()}
        others = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if len(others) == 1:
            with self._open(self.folder / others[0]) as handle:
                return {name: self.folder / others[0] for name in handle.keys()}
        hint = " (pickled .bin/.pt weights are never loaded: convert them to safetensors)" \
            if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")) else ""
        raise UserError(f"{self.folder}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path}: not a readable safetensors file ({e})") from None

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        return self._handles[path]

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.config
        shapes = global_shapes(cfg)
        for i in range(cfg.num_layers):
            shapes.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes(cfg).items()})
        return shapes

    def check(self) -> None:
        """Every tensor the config needs is present with the right shape (headers only, no data)."""
        for name, shape in self.shapes.items():
            self._shape_of(name, shape)

    def _shape_of(self, name: str, expected: tuple[int, ...]) -> str:
        """Checks the tensor's header against `expected`; returns its stored dtype (F32, F16, BF16)."""
        if name not in self.file_of:
            raise UserError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        path = self.file_of[name]
        handle = self._handle(path)
        try:
            info = handle.get_slice(name)
            shape, dtype = tuple(info.get_shape()), info.get_dtype()
        except SafetensorError as e:
            raise UserError(f"{path}: cannot read tensor {name} ({e})") from None
        if dtype not in ("F32", "F16", "BF16"):
            raise UserError(f"{path}: tensor {name} is stored as {dtype}; only F32, F16 and BF16 weights "
                            "are supported")
        if shape != tuple(expected):
            raise UserError(f"{path}: tensor {name} has shape {list(shape)}, "
                            f"but config.json implies {list(expected)}")
        return dtype

    def load(self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
        """One tensor, shape-checked, cast to dtype and moved to device."""
        expected = self.shapes.get(name)
        if expected is not None:
            self._shape_of(name, expected)
        elif name not in self.file_of:
            raise UserError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        path = self.file_of[name]
        try:
            tensor = self._handle(path).get_tensor(name)
        except SafetensorError as e:
            raise UserError(f"{path}: cannot read tensor {name} ({e})") from None
        # Always a fresh allocation: safetensors' memory map gives 8-byte aligned data, and CPU
        # matmul kernels round differently on unaligned weights (streamed blocks are aligned).
        return tensor.to(device=device, dtype=dtype, copy=True)

    def load_layer(self, index: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """All tensors of decoder layer `index`, keyed by their names relative to the layer."""
        prefix = f"model.layers.{index}."
        return {k: self.load(prefix + k, dtype, device) for k in layer_shapes(self.config)}

    def source_formats(self) -> dict[str, str]:
        """Each tensor's stored type as GGUF names it (F32, F16, BF16), from the headers."""
        return {name: self._shape_of(name, shape) for name, shape in self.shapes.items()}

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def open_checkpoint(folder: str | Path, config: ModelConfig):
    """A safetensors `Checkpoint`, or a `GGUFCheckpoint` for a GGUF model's folder."""
    from .gguf_model import GGUFCheckpoint, is_sidecar
    return GGUFCheckpoint(folder, config) if is_sidecar(Path(folder)) else Checkpoint(folder, config)


# ---- fingerprints: naming a checkpoint's weights wherever its folder sits ---------------------------

_SAMPLE_BYTES = 1 << 20
# the embeddings, and the first layer's query projection (which a LoRA merge or fine-tune changes
# even when it leaves the embeddings alone)
_SAMPLED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")


def fingerprint(folder: Path) -> str | None:
    """16 hex digits naming a checkpoint's weights, or None when the folder cannot be read (then
    no stored vector matches it; loading the model reports the real problem)."""
    folder = Path(folder)
    try:
        h = hashlib.sha256()
        h.update(json.dumps(json.loads((folder / "config.json").read_text(encoding="utf-8")), sort_keys=True).encode())
        tok = folder / "tokenizer.json"
        if tok.exists():
            h.update(tok.read_bytes())
        from .gguf_model import is_sidecar, tensor_head
        if is_sidecar(folder):  # the same model as a float32 folder has the same fingerprint
            for name in _SAMPLED:
                h.update(name.encode())
                h.update(tensor_head(folder, name, _SAMPLE_BYTES))
            return h.hexdigest()[:16]
        file_of = Checkpoint(folder, load_config(folder)).file_of
        for name in _SAMPLED:
            if name in file_of:
                h.update(name.encode())
                h.update(_tensor_head(file_of[name], name))
        return h.hexdigest()[:16]
    except (OSError, ValueError, KeyError, TypeError, struct.error, RecursionError, UserError):
        return None


def _tensor_head(path: Path, name: str) -> bytes:
    """The first MiB of one tensor's bytes, found through the safetensors header."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        start, end = header[name]["data_offsets"]
        f.seek(8 + header_len + start)
        return f.read(min(_SAMPLE_BYTES, end - start))
