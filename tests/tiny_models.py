"""Tiny random checkpoints in the Hugging Face layout, made by the tests themselves.

Each family is built with transformers' own config and model classes (the reference
implementation), saved with save_pretrained as safetensors, plus a real byte-level BPE
tokenizer trained on a few sentences and a ChatML chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding verifies a tree of draft tokens in one pass of the target model.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "Hello, world! How are you today? I am fine, thank you.",
]

FAMILIES = {
    # name: (transformers config class name, overrides)
    "llama2-mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "llama3-gqa": ("LlamaConfig", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "smollm-tied": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=100000.0)),
}


def train_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def make_tiny_checkpoint(path: str | Path, family: str = "llama3-gqa", seed: int = 0,
                         layers: int = 2, hidden: int = 64, heads: int = 4, intermediate: int = 128,
                         max_shard_size: str | None = None, init_std: float = 0.02) -> Path:
    """Write a tiny random checkpoint of `family` into `path`; returns the folder."""
    import transformers
    path = Path(path)
    tok = train_tokenizer()
    cls_name, overrides = FAMILIES[family]
    config = getattr(transformers, cls_name)(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=2, initializer_range=init_std, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers zero-initialises biases and norms: make them matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, init_std)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 512}))
    return path


def make_tiny_pair(root: str | Path) -> tuple[Path, Path]:
    """A 3-layer target and a 1-layer, half-width draft of another seed (same tokenizer): a draft
    that agrees with its target only by chance."""
    root = Path(root)
    target = make_tiny_checkpoint(root / "target", "llama3-gqa", layers=3, init_std=0.3, seed=1)
    draft = make_tiny_checkpoint(root / "draft", "llama3-gqa", layers=1, hidden=32, heads=2, intermediate=64,
                                 init_std=0.3, seed=2)
    return target, draft


def perturbed_copy(src: str | Path, dst: str | Path, noise: float, seed: int = 0, sharpen: float = 1.0) -> Path:
    """A copy of the checkpoint at `src` with every matrix w replaced by w + noise * std(w) * N(0, 1),
    and its head scaled by `sharpen` (a sharper draft draws the same token twice more often): a
    draft that agrees with its target often but not always (some tree nodes accepted, others not)."""
    import shutil

    from safetensors.torch import load_file, save_file
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for path in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(path))
        tensors = {k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
                   for k, v in tensors.items()}
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"] = tensors["lm_head.weight"] * sharpen
        save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


def greedy_past_eos(folder, prompt: str, max_new_tokens: int, **load_kw):
    """Greedy decoding that does not stop at end-of-sequence tokens, so that two runs compare
    token for token over a fixed length, on an engine loaded with `load_kw` and closed after.
    Returns (GenerationResult, the closed engine)."""
    from offload_engine import Engine
    engine = Engine.load(folder, progress=False, **load_kw)
    engine.eos_token_ids = frozenset()
    try:
        return engine.generate(prompt, max_new_tokens=max_new_tokens), engine
    finally:
        engine.close()


def slow_fills(monkeypatch, seconds: float) -> None:
    """Every layer fill of the streaming executor takes `seconds` more (a sleep before the real
    fill), so that a pass waits for its layers: a tiny model's otherwise arrive before they are
    wanted, and nothing is grown in the waits."""
    import time
    from offload_engine.runtime import streamer
    fill = streamer.LayerExecutor._fill

    def slow(self, *args):
        time.sleep(seconds)
        return fill(self, *args)
    monkeypatch.setattr(streamer.LayerExecutor, "_fill", slow)
