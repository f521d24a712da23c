"""Model configuration read from a checkpoint's config.json (and generation_config.json)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16; refuses anything else."""
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}: use one of float32, float16, bfloat16")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency scaling ('llama3'), or plain linear scaling."""
    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def max_context(self) -> int:
        """Longest sequence that the model computes exactly (sliding-window models stop at the window)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


MAX_JSON_BYTES = 64 * 2**20  # a configuration file is KiBs (a tokenizer_config.json with templates, MiBs)


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; any other content is a UserError naming the file."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise UserError(f"{path}: {path.stat().st_size} bytes, too large for a configuration file "
                            f"(at most {MAX_JSON_BYTES})")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise UserError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise UserError(f"{path}: not valid JSON (nested too deeply)") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(path: Path, key: str, value: Any, low: int = 1, high: int = 2**31 - 1) -> int:
    """A size or count: a whole number in low..high (4096.0 counts as whole)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{path}: {key} must be a whole number in {low}..{high}, got {_shown(value)}")
    return value


def _positive(path: Path, key: str, value: Any) -> float:
    """A finite number > 0 (an epsilon, a base frequency, a factor)."""
    number = float(value) if isinstance(value, float) or (
        isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1e300) else math.nan
    if not (math.isfinite(number) and number > 0):  # 1e300: larger integers overflow a float
        raise UserError(f"{path}: {key} must be a finite positive number, got {_shown(value)}")
    return number


def _ids(value: Any, path: Path, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UserError(f"{path}: {key} must be a token id or a list of token ids, got {_shown(value)}")
    return tuple(values)


def _rope_scaling(raw: Any, path: Path) -> RopeScaling | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: rope_scaling must be an object, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise UserError(f"{path}: rope_scaling type {kind!r} is not supported (supported: llama3, linear)")
    if "factor" not in raw:
        raise UserError(f"{path}: rope_scaling {kind} needs 'factor'")
    rs = RopeScaling(kind, _positive(path, "rope_scaling factor", raw["factor"]),
                     _positive(path, "rope_scaling low_freq_factor", raw.get("low_freq_factor", 1.0)),
                     _positive(path, "rope_scaling high_freq_factor", raw.get("high_freq_factor", 4.0)),
                     _whole(path, "rope_scaling original_max_position_embeddings",
                            raw.get("original_max_position_embeddings", 8192)))
    if kind == "llama3" and not rs.high_freq_factor > rs.low_freq_factor:
        raise UserError(f"{path}: rope_scaling high_freq_factor must be > low_freq_factor, got {raw}")
    return rs


def load_config(folder: str | Path) -> ModelConfig:
    """Read config.json (and generation_config.json when present) from a checkpoint folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"checkpoint folder {folder} does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{folder}: no config.json (is this a Hugging Face checkpoint folder?)")
    raw = read_json_object(path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{path}: model_type {model_type!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?") if isinstance(
            raw["quantization_config"], dict) else "?"
        raise UserError(f"{path}: quantised checkpoints ({_shown(method)}) are not supported; use bf16/fp16/fp32 "
                        "safetensors, or convert a GGUF file with convert-gguf")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UserError(f"{path}: hidden_act {act!r} is not supported (Llama-family models use silu)")
    # transformers >= 5 writes "rope_parameters"; checkpoints on the Hub carry rope_theta/rope_scaling.
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{path}: rope_parameters must be an object")
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                            "num_hidden_layers") if k not in raw]
    if missing:
        raise UserError(f"{path}: missing field {missing[0]!r}")
    hidden = _whole(path, "hidden_size", raw["hidden_size"])
    heads = _whole(path, "num_attention_heads", raw["num_attention_heads"])
    cfg = dict(
        model_type=model_type,
        vocab_size=_whole(path, "vocab_size", raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=_whole(path, "intermediate_size", raw["intermediate_size"]),
        num_layers=_whole(path, "num_hidden_layers", raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=_whole(path, "num_key_value_heads", raw.get("num_key_value_heads") or heads),
        head_dim=_whole(path, "head_dim", raw.get("head_dim") or hidden // heads),
        rms_norm_eps=_positive(path, "rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_positive(path, "rope_theta", raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=_whole(path, "max_position_embeddings", raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    if cfg["head_dim"] % 2:
        raise UserError(f"{path}: head_dim {cfg['head_dim']} is odd (rotary embeddings rotate pairs)")
    if cfg["num_heads"] % cfg["num_kv_heads"]:
        raise UserError(f"{path}: num_attention_heads {heads} is not a multiple of "
                        f"num_key_value_heads {cfg['num_kv_heads']}")
    if model_type == "qwen2":
        cfg["qkv_bias"] = True
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    else:
        cfg["qkv_bias"] = cfg["o_bias"] = bool(raw.get("attention_bias", False))
        cfg["mlp_bias"] = bool(raw.get("mlp_bias", False))
        window = raw.get("sliding_window") if model_type == "mistral" else None
    cfg["sliding_window"] = _whole(path, "sliding_window", window) if window else None
    cfg["rope_scaling"] = _rope_scaling(raw.get("rope_scaling") or rope, path)
    cfg["torch_dtype"] = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
    gen_path = folder / "generation_config.json"
    gen = read_json_object(gen_path) if gen_path.is_file() else {}
    bos = gen.get("bos_token_id", raw.get("bos_token_id"))
    cfg["bos_token_id"] = int(bos) if isinstance(bos, int) else None
    cfg["eos_token_ids"] = tuple(dict.fromkeys(_ids(raw.get("eos_token_id"), path, "eos_token_id")
                                               + _ids(gen.get("eos_token_id"), gen_path, "eos_token_id")))
    pad = raw.get("pad_token_id")
    cfg["pad_token_id"] = int(pad) if isinstance(pad, int) else None
    return ModelConfig(**cfg)
