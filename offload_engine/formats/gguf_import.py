"""Convert a llama-architecture GGUF file into a Hugging Face checkpoint folder.

The result is what `LlamaForCausalLM.from_pretrained` and this runtime's loader read: config.json,
model.safetensors (or shards plus model.safetensors.index.json), tokenizer.json,
tokenizer_config.json, special_tokens_map.json and generation_config.json.

Three things a GGUF does differently from the Hugging Face layout are undone here:
  * weights may be quantised (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): they are dequantised with the
    `gguf` package, so the output holds plain float tensors;
  * llama.cpp's converter permutes the rows of q_proj and k_proj (and their biases) for its RoPE
    layout; the exact inverse is applied;
  * the tokenizer exists only as metadata (tokens, merges or scores, token types, and the *name* of
    a pre-tokenizer); tokenizer.json is rebuilt from it, with llama.cpp's split rules for that name.

Everything is written into a temporary folder beside `out_dir` and renamed into place only once
complete, so a crash or a refusal never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..fsutil import fsync_path, fsync_tree
from . import gguf_blocks
from .config import DTYPE_NAMES, parse_dtype
from .gguf_check import check_layout, meta_float, meta_int
from .gguf_tokenizer import KNOWN_PRE_TOKENIZERS, build_tokenizer  # noqa: F401 (re-exported)

# Bump when the output of the converter changes (layout, tokenizer rules, config fields): cached
# conversions keyed on it are then redone.
FORMAT_VERSION = 1

SUPPORTED_TENSOR_TYPES = gguf_blocks.SUPPORTED  # F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K


class OutputExistsError(UserError):
    """The output folder already exists and is not empty (perhaps a concurrent conversion won)."""


# --------------------------------------------------------------------------------------------
# GGUF reading helpers
# --------------------------------------------------------------------------------------------

def _open_reader(path: Path):
    import gguf

    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    check_layout(path)  # every count and length against the file's size: the reader trusts them
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # corrupt header, truncated file, unsupported version
        raise UserError(f"{path}: cannot read this GGUF file ({type(e).__name__}: {e})") from None


def _field_value(field) -> Any:
    try:
        return field.contents()
    except UnicodeDecodeError:
        # A string (or string array) that is not valid UTF-8: decode each part leniently.
        from gguf import GGUFValueType

        if field.types and field.types[0] == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _read_metadata(reader) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# --------------------------------------------------------------------------------------------
# Tensor names and layout
# --------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_ATTN_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output")
_MLP_PROJ = ("ffn_gate", "ffn_up", "ffn_down")


@dataclass
class _Entry:
    """One output tensor: where it comes from and what it must look like (rows first)."""
    hf_name: str
    shape: tuple[int, ...]
    source: Any = None          # gguf ReaderTensor, or None for a zero-filled bias
    unpermute_heads: int = 0    # undo llama.cpp's q/k row permutation with this many heads


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's `w.reshape(n_head, 2, rows//n_head//2, *rest).swapaxes(1, 2).reshape(w.shape)`.

    Works for weights (rows, cols) and biases (rows,).
    """
    rows, rest = w.shape[0], tuple(w.shape[1:])
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation (Hugging Face layout -> GGUF layout); the inverse of `unpermute_rows`."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


# --------------------------------------------------------------------------------------------
# Llama 3.1 rope frequency factors
# --------------------------------------------------------------------------------------------

def llama3_rope_factors(rope_theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The per-frequency divisors that llama.cpp's converter stores as `rope_freqs.weight`."""
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float64)


def _recover_rope_scaling(path: Path, meta: dict, rope_freqs, rope_theta: float, head_dim: int) -> dict | None:
    arch = "llama"  # metadata prefix
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if factor not in (None, 0):
        factor = meta_float(path, meta, f"{arch}.rope.scaling.factor", 1.0)
    if rope_freqs is None:
        if kind in (None, "none") or factor in (None, 0, 1, 1.0):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        raise UserError(f"{path}: rope scaling type {kind!r} is not supported (supported: linear, llama3)")

    import gguf

    if rope_freqs.tensor_type != gguf.GGMLQuantizationType.F32:
        raise UserError(f"{path}: tensor rope_freqs.weight has type {rope_freqs.tensor_type.name}, expected F32")
    divisors = np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1)
    if divisors.shape[0] != head_dim // 2:
        raise UserError(f"{path}: tensor rope_freqs.weight has {divisors.shape[0]} values, "
                        f"expected head_dim/2 = {head_dim // 2}")
    if np.all(divisors == 1.0):
        return None
    low = meta_float(path, meta, f"{arch}.rope.scaling.low_freq_factor", 1.0)
    high = meta_float(path, meta, f"{arch}.rope.scaling.high_freq_factor", 4.0)
    orig = meta_int(path, meta, f"{arch}.rope.scaling.original_context_length", 8192)
    if not high > low:
        raise UserError(f"{path}: rope scaling high_freq_factor {high:g} must be greater than low_freq_factor "
                        f"{low:g}")
    candidates = []
    if factor not in (None, 0):
        candidates.append(float(factor))
    else:
        # The standard Llama 3.1 factor, then the one the tensor itself shows for its longest
        # wavelengths (Llama 3.2 uses 32).
        candidates += [8.0, float(divisors.max())]
    for cand in candidates:
        expect = llama3_rope_factors(rope_theta, head_dim, cand, low, high, orig)
        if np.all(np.abs(expect - divisors) <= 1e-3 * np.abs(expect)):
            return {"rope_type": "llama3", "factor": cand, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise UserError(f"{path}: tensor rope_freqs.weight does not match Llama 3 rope scaling with factor "
                    f"{' or '.join(f'{c:g}' for c in candidates)}, low_freq_factor {low:g}, high_freq_factor "
                    f"{high:g}, original context {orig}; this rope scaling is not supported")


# --------------------------------------------------------------------------------------------
# Model plan: config + tensor list
# --------------------------------------------------------------------------------------------

def _plan_model(path: Path, reader, meta: dict) -> tuple[dict, list[_Entry]]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama' is)")
    if meta.get("llama.expert_count") not in (None, 0):
        raise UserError(f"{path}: mixture-of-experts llama GGUF ({meta['llama.expert_count']!r} experts) "
                        "is not supported")
    n_layers = meta_int(path, meta, "llama.block_count", high=1 << 16)
    if len(_BLOCK_NAMES) * n_layers > len(reader.tensors):
        raise UserError(f"{path}: llama.block_count is {n_layers}, but the file holds only {len(reader.tensors)} "
                        f"tensors ({len(_BLOCK_NAMES)} a layer)")
    hidden = meta_int(path, meta, "llama.embedding_length")
    inter = meta_int(path, meta, "llama.feed_forward_length")
    heads = meta_int(path, meta, "llama.attention.head_count")
    kv_heads = meta_int(path, meta, "llama.attention.head_count_kv", heads)
    head_dim = meta_int(path, meta, "llama.attention.key_length", max(1, hidden // heads))
    if head_dim % 2:
        raise UserError(f"{path}: the attention heads' size {head_dim} is odd (rotary embeddings rotate pairs)")
    v_dim = meta_int(path, meta, "llama.attention.value_length", head_dim)
    if v_dim != head_dim:
        raise UserError(f"{path}: attention key_length {head_dim} != value_length {v_dim}; not supported")
    rope_dim = meta_int(path, meta, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UserError(f"{path}: rope.dimension_count {rope_dim} differs from head_dim {head_dim} "
                        "(partial rotary embeddings are not supported)")
    if heads % kv_heads:
        raise UserError(f"{path}: head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    rope_theta = meta_float(path, meta, "llama.rope.freq_base", 10000.0)
    eps = meta_float(path, meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)
    ctx = meta_int(path, meta, "llama.context_length", 4096)

    allowed = set(SUPPORTED_TENSOR_TYPES)
    by_name: dict[str, Any] = {}
    rope_freqs = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            rope_freqs = t
            continue
        m = _BLOCK_RE.match(t.name)
        if t.name in _GLOBAL_NAMES:
            pass
        elif m and int(m.group(1)) < n_layers and m.group(2) in _BLOCK_NAMES and (
                m.group(3) == "weight" or m.group(2) in _ATTN_PROJ + _MLP_PROJ):
            pass
        else:
            raise UserError(f"{path}: unexpected tensor {t.name!r} for a llama model with {n_layers} layers")
        if t.tensor_type.name not in allowed:
            raise UserError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported "
                            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
        by_name[t.name] = t

    if "token_embd.weight" not in by_name:
        raise UserError(f"{path}: tensor 'token_embd.weight' is missing")
    embd_shape = [int(x) for x in by_name["token_embd.weight"].shape]
    if len(embd_shape) != 2 or not embd_shape[1]:
        raise UserError(f"{path}: tensor 'token_embd.weight' has shape {embd_shape[::-1]} (rows first), "
                        "not one row per token")
    vocab = embd_shape[1]  # GGUF shapes are (cols, rows)
    tied = "output.weight" not in by_name
    attn_bias = any(f"blk.{i}.{p}.bias" in by_name for i in range(n_layers) for p in _ATTN_PROJ)
    mlp_bias = any(f"blk.{i}.{p}.bias" in by_name for i in range(n_layers) for p in _MLP_PROJ)

    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    shapes = {
        "attn_norm": (hidden,), "ffn_norm": (hidden,),
        "attn_q": (q_rows, hidden), "attn_k": (kv_rows, hidden), "attn_v": (kv_rows, hidden),
        "attn_output": (hidden, q_rows),
        "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter),
    }
    entries: list[_Entry] = []

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], heads_: int = 0, optional: bool = False):
        t = by_name.get(gguf_name)
        if t is None:
            if optional:
                entries.append(_Entry(hf_name, shape, None, 0))
                return
            raise UserError(f"{path}: tensor {gguf_name!r} is missing")
        got = tuple(int(x) for x in reversed(list(t.shape)))
        if got != shape:
            raise UserError(f"{path}: tensor {gguf_name!r} has shape {list(got)} (rows first), expected {list(shape)}")
        entries.append(_Entry(hf_name, shape, t, heads_))

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    for i in range(n_layers):
        for short, hf in _BLOCK_NAMES.items():
            heads_ = heads if short == "attn_q" else kv_heads if short == "attn_k" else 0
            add(f"blk.{i}.{short}.weight", f"model.layers.{i}.{hf}.weight", shapes[short], heads_)
            if (short in _ATTN_PROJ and attn_bias) or (short in _MLP_PROJ and mlp_bias):
                # Hugging Face's llama has one flag for all four attention biases (one for the three
                # MLP ones): a bias the GGUF lacks is written as zeros, which is what it means.
                add(f"blk.{i}.{short}.bias", f"model.layers.{i}.{hf}.bias", shapes[short][:1], heads_, optional=True)
    add("output_norm.weight", "model.norm.weight", (hidden,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, hidden))

    rope_scaling = _recover_rope_scaling(path, meta, rope_freqs, rope_theta, head_dim)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "attention_bias": attn_bias,
        "attention_dropout": 0.0,
        "mlp_bias": mlp_bias,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if head_dim != hidden // heads or hidden % heads:
        config["head_dim"] = head_dim
    return config, entries


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------



def _check_size(path: Path, e: _Entry) -> None:
    """The bytes the file holds for a tensor are what its type and shape need."""
    if e.source is None:
        return
    t = e.source
    cols = e.shape[-1]
    block = gguf_blocks.BLOCK_SIZES[t.tensor_type.name][0]
    if cols % block:
        raise UserError(f"{path}: tensor {t.name!r} has rows of {cols} weights, not a whole number of "
                        f"{t.tensor_type.name} blocks of {block}")
    need = gguf_blocks.nbytes(t.tensor_type.name, math.prod(e.shape))
    if int(t.n_bytes) != need or t.data.nbytes != need:
        raise UserError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape {list(e.shape)}) needs {need} "
                        f"bytes, the file holds {int(t.data.nbytes)} (truncated or damaged file?)")


def _materialize(path: Path, e: _Entry, dtype: torch.dtype) -> torch.Tensor:
    if e.source is None:
        return torch.zeros(e.shape, dtype=dtype)
    t = e.source
    raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy())  # the file's bytes
    try:
        w = gguf_blocks.dequantize(raw, t.tensor_type.name, e.shape)  # bitwise gguf.quants.dequantize
    except ValueError as err:
        raise UserError(f"{path}: tensor {t.name!r}: {err}") from None
    if e.unpermute_heads:
        w = unpermute_rows(w, e.unpermute_heads)
    return w.to(dtype).contiguous()


def _write_weights(path: Path, folder: Path, entries: list[_Entry], dtype: torch.dtype, shard_bytes: int,
                   progress: bool) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    item = torch.empty((), dtype=dtype).element_size()
    shards: list[list[_Entry]] = []
    size = 0
    for e in entries:
        nbytes = math.prod(e.shape) * item
        if not shards or (size + nbytes > shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    total = sum(math.prod(e.shape) * item for e in entries)
    count = len(shards)
    weight_map = {}
    bar = tqdm(total=len(entries), desc="converting GGUF", unit="tensor", file=sys.stderr, disable=not progress)
    try:
        for k, shard in enumerate(shards, 1):
            fname = "model.safetensors" if count == 1 else f"model-{k:05d}-of-{count:05d}.safetensors"
            tensors = {}
            for e in shard:
                tensors[e.hf_name] = _materialize(path, e, dtype)
                weight_map[e.hf_name] = fname
                bar.update(1)
            save_file(tensors, str(folder / fname), metadata={"format": "pt"})
            os.chmod(folder / fname, _file_mode())  # safetensors creates its files 0600
            del tensors
    finally:
        bar.close()
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _make_temp_dir(out_dir: Path) -> Path:
    """An empty folder beside `out_dir`, created with the usual (umask) permissions."""
    for _ in range(100):
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
    raise UserError(f"{out_dir.parent}: cannot create a temporary folder for the conversion")


def _file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                 shard_bytes: int = 4 * 2**30, progress: bool = True, weights: bool = True) -> Path:
    """Convert a llama GGUF file into a Hugging Face checkpoint folder `out_dir`; returns its path.

    Refuses (UserError) a file that is not GGUF, an architecture other than llama, tensor types it
    cannot dequantise, unknown pre-tokenizers, and an `out_dir` that exists and is not empty
    (OutputExistsError). `shard_bytes` bounds each safetensors file (one tensor larger than it gets
    a file of its own); only one shard's tensors are in memory at a time. With weights=False no
    tensor is written: the folder names the GGUF file instead (`gguf_model.SIDECAR_FILE`), and
    the runtime reads its tensors from there in their own block formats.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    dtype = parse_dtype(dtype)
    if dtype not in DTYPE_NAMES:
        raise UserError(f"dtype {dtype} is not supported for conversion (use float32, float16 or bfloat16)")
    if shard_bytes <= 0:
        raise UserError(f"shard_bytes must be positive, got {shard_bytes}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise OutputExistsError(f"{out_dir}: already exists and is not empty; choose a new output folder")

    reader = _open_reader(gguf_path)
    meta = _read_metadata(reader)
    config, entries = _plan_model(gguf_path, reader, meta)
    tk = build_tokenizer(gguf_path, meta)
    if tk.bos_id is not None:
        config["bos_token_id"] = tk.bos_id
    if tk.eos_id is not None:
        config["eos_token_id"] = tk.eos_id
    if tk.pad_id is not None:
        config["pad_token_id"] = tk.pad_id
    config["torch_dtype"] = DTYPE_NAMES[dtype]
    n_tokens = len(meta.get("tokenizer.ggml.tokens") or [])
    if n_tokens > config["vocab_size"]:
        raise UserError(f"{gguf_path}: the tokenizer has {n_tokens} tokens but token_embd.weight only "
                        f"{config['vocab_size']} rows")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_temp_dir(out_dir)
    done = False
    try:
        for e in entries:  # every tensor's size against its type and shape, before it is trusted
            _check_size(gguf_path, e)
        if weights:
            _write_weights(gguf_path, tmp, entries, dtype, shard_bytes, progress)
        else:
            st = gguf_path.stat()
            tensors = [[e.hf_name, list(e.shape), e.unpermute_heads] + (
                [e.source.name, e.source.tensor_type.name, int(e.source.data_offset), int(e.source.n_bytes)]
                if e.source is not None else []) for e in entries]
            _dump(tmp / "gguf.json", {"file": str(gguf_path.resolve()), "size": st.st_size,
                                      "mtime_ns": st.st_mtime_ns, "format": FORMAT_VERSION, "tensors": tensors})
        _dump(tmp / "config.json", config)
        gen = {"bos_token_id": tk.bos_id,
               "eos_token_id": tk.eos_ids[0] if len(tk.eos_ids) == 1 else (tk.eos_ids or None)}
        if tk.pad_id is not None:
            gen["pad_token_id"] = tk.pad_id
        _dump(tmp / "generation_config.json", gen)
        (tmp / "tokenizer.json").write_text(tk.tokenizer_json, encoding="utf-8")
        specials = {k: v for k, v in (("bos_token", tk.bos), ("eos_token", tk.eos), ("unk_token", tk.unk),
                                      ("pad_token", tk.pad)) if v is not None}
        tok_cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "add_bos_token": tk.add_bos,
            "add_eos_token": tk.add_eos,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
        }
        if meta.get("tokenizer.chat_template"):
            tok_cfg["chat_template"] = meta["tokenizer.chat_template"]
        _dump(tmp / "tokenizer_config.json", tok_cfg)
        _dump(tmp / "special_tokens_map.json", specials)
        fsync_tree(tmp)  # its files on the disk before its name is: a power cut never leaves empty ones
        if out_dir.is_dir():
            try:
                out_dir.rmdir()  # an empty folder: take its place
            except OSError:
                pass
        try:
            os.rename(tmp, out_dir)
        except OSError as e:
            if out_dir.exists():
                raise OutputExistsError(f"{out_dir}: appeared while converting (another conversion?)") from None
            raise UserError(f"{out_dir}: cannot move the converted checkpoint into place ({e})") from None
        done = True
        fsync_path(out_dir.parent)  # the rename itself on the disk
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
