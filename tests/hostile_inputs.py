"""Hostile inputs for the fuzzed-parser suite (issue 22, item 1): a valid small example of every
file a user can point the runtime at, and the hypothesis draws that damage it (the binary formats,
safetensors and GGUF, in hostile_binary.py).

Each `build_*` writes one input into an empty folder and returns the path a loader is given. With
`draw=None` it writes the valid example unchanged (the runner checks that it loads: a fuzz whose
base does not load tests nothing); otherwise `draw` (hypothesis' `data.draw`) picks the damage:
values replaced at random paths of a JSON document with hostile ones (integers near 2^64, NaN,
wrong types, deep nesting), raw bytes truncated or flipped, and for the binary formats every
length and count field, and every section boundary of the file, as a target.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st

BIG_INTS = [0, 1, -1, 2, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 2,
            2**64 - 1, 2**64, 10**30, -(2**63), 10**400]  # 10**400: an integer no float holds
WORDS = ["", "llama", "silu", "linear", "llama3", "default", "gpt2", "F32", "BF16", "F8_E4M3", "64", "NaN",
         "../../etc/passwd", "/tmp", "model.safetensors", "\u2028", "\x00", "{{ x }}", "a" * 300]
DELETE = object()


# Characters that text handling gets wrong (line breaks other than "\n", a BOM, NUL, combining and
# right-to-left marks, astral planes), from a fixed list: hypothesis' full-Unicode text strategy
# costs seconds and ~200 MiB to set up in every fresh process.
ALPHABET = list("az AZ09{}[]\":,.\\/-") + ["\t", "\r", "\n", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029",
                                          "\ufeff", "\x00", "\u0301", "\u200f", "\uffff", "\u00e9", "\u4e2d",
                                          "\U0001f600", "\U0010ffff"]
TEXT = st.text(st.sampled_from(ALPHABET), max_size=12)
LEAVES = st.one_of(st.sampled_from(BIG_INTS), st.integers(-5, 70), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from(WORDS), TEXT, st.booleans(), st.none())
# Any JSON value, small, biased towards the numbers and strings parsers get wrong.
HOSTILE_JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.sampled_from(WORDS) | TEXT, inner, max_size=3), max_leaves=8)
EDITS = st.integers(1, 4)
VALUE_OR_DELETE = st.one_of(st.just(DELETE), HOSTILE_JSON)


def mutate_doc(draw, doc, keys: list[str] = ()):
    """Replace or delete values at random paths of a JSON document (in place; returns it)."""
    for _ in range(draw(EDITS)):
        parent, key = None, None
        node = doc
        while isinstance(node, (dict, list)) and node and (parent is None or draw(st.booleans())):
            options = list(node) if isinstance(node, dict) else list(range(len(node)))
            if isinstance(node, dict) and parent is None:
                options += [k for k in keys if k not in node]
            parent, key = node, draw(st.sampled_from(options))
            node = parent[key] if not isinstance(parent, dict) or key in parent else None
        if parent is None:
            return draw(HOSTILE_JSON)
        value = draw(VALUE_OR_DELETE)
        if value is DELETE:
            parent.pop(key, None) if isinstance(parent, dict) else parent.pop(key)
        else:
            parent[key] = value
    return doc


RAW_SPECIALS = [b"", b"null", b"[]", b"\"x\"", b"[" * 100_000, b"{\"a\":" * 50_000, b"1" * 5000,
                b"{\"x\": " + b"9" * 5000 + b"}", b"\xff\xfe{}", b"\x00" * 64, b"{} {}", b"NaN"]


def damage_bytes(draw, data: bytes) -> bytes:
    """A byte string damaged: cut short, bytes overwritten, junk appended, or replaced whole."""
    kind = draw(st.sampled_from(["cut", "flip", "append", "special", "bom"]))
    if kind == "cut":
        return data[:draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            if out:
                out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        return bytes(out)
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    if kind == "bom":
        return "\ufeff".encode() + data
    return draw(st.sampled_from(RAW_SPECIALS))


def json_bytes(draw, doc, keys: list[str] = ()) -> bytes:
    """A document mutated at random paths (most draws), or its text damaged."""
    if draw(st.integers(0, 3)) == 0:
        return damage_bytes(draw, json.dumps(doc).encode())
    return json.dumps(mutate_doc(draw, doc, keys)).encode()


# Deterministic sweeps: every field of a document given each of these values, and a few raw
# files, so that each known class of damage is tried on every run whatever hypothesis draws.
SWEEP_VALUES = [0, -1, 10**400, 2**64, float("nan"), float("inf"), "64", [1], {"a": 1}, None, True]
RAW_SWEEP = [b"[" * 100_000, b"{\"x\": " + b"9" * 5000 + b"}", b"\xff\xfe{}", b"", b"[]"]


def _set(doc, path: tuple, value):
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def json_sweep(base, write, paths: list, values: list = SWEEP_VALUES) -> list:
    """(label, build) pairs: `base` with each path set to each value, then each raw file; `write`
    (folder, bytes) -> path writes one."""
    out = []
    for path in paths:
        path = path if isinstance(path, tuple) else (path,)
        for i, value in enumerate(values):
            doc = json.loads(json.dumps(base))
            _set(doc, path, value)
            out.append((f"{'.'.join(map(str, path))}={i}",
                        lambda folder, data=json.dumps(doc).encode(): write(folder, data)))
    return out + [(f"raw-{i}", lambda folder, raw=raw: write(folder, raw)) for i, raw in enumerate(RAW_SWEEP)]


def built_then_written(build, name: str):
    """A json_sweep writer: the undamaged folder from `build`, then its file `name` replaced by the data."""
    def write(folder: Path, data: bytes) -> Path:
        build(folder)
        (folder / name).write_bytes(data)
        return folder
    return write


# ---- config.json / generation_config.json ---------------------------------------------------

def base_config() -> dict:
    return {"model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}


CONFIG_KEYS = ["head_dim", "sliding_window", "use_sliding_window", "quantization_config", "rope_parameters",
               "attention_bias", "mlp_bias", "pad_token_id", "dtype"]


def build_config(folder: Path, draw=None) -> Path:
    (folder / "config.json").write_bytes(json.dumps(base_config()).encode())
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3]}))
    if draw is not None:
        for name in draw(st.sampled_from([["config.json"], ["generation_config.json"],
                                          ["config.json", "generation_config.json"]])):
            doc = json.loads((folder / name).read_text())
            (folder / name).write_bytes(json_bytes(draw, doc, CONFIG_KEYS if name == "config.json" else ["pad"]))
    return folder


def config_sweep() -> list:
    rope = [("rope_scaling", k) for k in base_config()["rope_scaling"]]
    return json_sweep(base_config(), built_then_written(build_config, "config.json"),
                      list(base_config()) + CONFIG_KEYS + rope)


# ---- tokenizer.json, tokenizer_config.json, chat_template.jinja --------------------------------

_TOKENIZER_JSON: list[str] = []


def base_tokenizer_json() -> str:
    if not _TOKENIZER_JSON:
        from tiny_models import train_tokenizer
        _TOKENIZER_JSON.append(train_tokenizer().to_str())
    return _TOKENIZER_JSON[0]


def base_tokenizer_config() -> dict:
    from tiny_models import CHATML
    return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>", "unk_token": None, "add_bos_token": False, "model_max_length": 512}


TOKENIZER_EDITS = [
    ("model", "type", ["BPE", "WordPiece", "Unigram", "WordLevel", "Nope", 5]),
    ("model", "unk_token", ["<nope>", 7, ""]),
    ("model", "vocab", [{"a": 2**40}, {"a": -1}, {"a": 0, "b": 0}, [["a", 1.5]], {}]),
    ("model", "merges", [["z q"], [["<nope>", "x"]], ["a"], [5], [["a", "b", "c"]]]),
    (None, "added_tokens", [[{"id": 2**40, "content": "x", "special": True}], [{"id": -1, "content": "y"}],
                            [{"content": 5}], [{"id": 0}], "x"]),
    (None, "normalizer", [{"type": "Replace", "pattern": {"Regex": "("}, "content": ""}, {"type": "Nope"},
                          {"type": "Sequence", "normalizers": [{"type": "Sequence", "normalizers": []}] * 3}]),
    (None, "pre_tokenizer", [{"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated",
                              "invert": False}, {"type": "Split", "pattern": {"Regex": "[z-a]"}},
                             {"type": "Metaspace", "replacement": "ab"}, {"type": "Nope"}]),
    (None, "decoder", [{"type": "Nope"}, {"type": "Replace", "pattern": {"String": ""}, "content": "x"}]),
    (None, "post_processor", [{"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>",
                                                                                           "type_id": 0}}],
                               "pair": [], "special_tokens": {}}]),
]
TOKENIZER_CONFIG_KEYS = ["chat_template", "bos_token", "eos_token", "added_tokens_decoder"]


def build_tokenizer(folder: Path, draw=None) -> Path:
    doc = json.loads(base_tokenizer_json())
    config = base_tokenizer_config()
    template = None
    if draw is not None:
        target = draw(st.sampled_from(["edit", "tokenizer", "config", "config", "template"]))
        if target == "edit":
            where, key, values = draw(st.sampled_from(TOKENIZER_EDITS))
            (doc[where] if where else doc)[key] = draw(st.sampled_from(values))
        elif target == "tokenizer":
            doc = json_bytes(draw, doc)
        elif target == "config":
            config = json_bytes(draw, config, TOKENIZER_CONFIG_KEYS)
        else:
            del config["chat_template"]
            template = draw(st.sampled_from([b"\xff\xfe{{", b"{% for %}", b"", "\u2028{{ x }}".encode()]))
    (folder / "tokenizer.json").write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    (folder / "tokenizer_config.json").write_bytes(config if isinstance(config, bytes) else
                                                   json.dumps(config).encode())
    if template is not None:
        (folder / "chat_template.jinja").write_bytes(template)
    return folder


def tokenizer_sweep() -> list:
    paths = TOKENIZER_CONFIG_KEYS + [("bos_token",), ("eos_token",)]
    out = json_sweep(base_tokenizer_config(), built_then_written(build_tokenizer, "tokenizer_config.json"), paths[:4])
    for where, key, values in TOKENIZER_EDITS:  # every targeted tokenizer.json edit
        for i, value in enumerate(values):
            def build(folder, where=where, key=key, value=value):
                build_tokenizer(folder)
                doc = json.loads((folder / "tokenizer.json").read_text())
                (doc[where] if where else doc)[key] = value
                (folder / "tokenizer.json").write_text(json.dumps(doc))
                return folder
            out.append((f"tokenizer.json:{where}.{key}={i}", build))
    return out


# ---- JSONL prompt files -----------------------------------------------------------------------

UNICODE = TEXT
EDGE_TEXT = st.sampled_from(["line\u2028sep", "para\u2029sep", "nel\x85", "vt\x0b", "ff\x0c", "cr\r", "fs\x1c",
                             "tab\t", "", " "])


MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": UNICODE | EDGE_TEXT}), min_size=1, max_size=3)
LINE = st.one_of(UNICODE.map(lambda s: s.replace("\n", " ").encode()),
                 HOSTILE_JSON.map(lambda v: json.dumps(v).encode()),
                 MESSAGES.map(lambda m: json.dumps({"messages": m}).encode()),
                 st.sampled_from(RAW_SPECIALS), st.binary(max_size=16))


def build_prompts(folder: Path, draw=None) -> Path:
    """prompts.jsonl: valid lines (whose parse must give back exactly what was written, recorded
    in expected.json beside it), or hostile ones."""
    path = folder / "prompts.jsonl"
    if draw is None:
        lines = [{"messages": [{"role": "user", "content": "Hello"}]}, [{"role": "user", "content": "Hi"}]]
        path.write_text("\n".join(json.dumps(x) for x in lines) + "\nplain prompt\n")
        return path
    if draw(st.booleans()):  # a round trip: any text, written as JSONL (ensure_ascii=False) reads back whole
        items = draw(st.lists(MESSAGES, min_size=1, max_size=4))
        newline = draw(st.sampled_from(["\n", "\r\n"]))
        path.write_text(newline.join(json.dumps({"messages": m}, ensure_ascii=False) for m in items) + newline,
                        encoding="utf-8", newline="")
        (folder / "expected.json").write_text(json.dumps([{"messages": m} for m in items]))
        return path
    data = b"\n".join(draw(st.lists(LINE, max_size=5)))
    path.write_bytes(damage_bytes(draw, data) if draw(st.integers(0, 3)) == 0 else data)
    return path


def prompts_sweep() -> list:
    def write(folder: Path, data: bytes) -> Path:
        (folder / "prompts.jsonl").write_bytes(data)
        return folder / "prompts.jsonl"
    base = {"messages": [{"role": "user", "content": "Hello"}]}
    paths = ["messages", ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content")]
    return json_sweep(base, write, paths)


# ---- hardware profiles and acceptance vectors ------------------------------------------------

def base_measured() -> dict:
    return {"machine": "test cpu", "device": "cpu", "dtype": "float32", "target": "/x/tiny",
            "target_fingerprint": "0123456789abcdef", "draft_key": "self-int8", "plan": {"resident": 0},
            "stream_source": "none", "stream_gb_per_s": 0.0, "prefix_tokens": 32, "target_tokens": [1, 2, 4, 8],
            "target_pass_s": [0.1, 0.11, 0.12, 0.15], "draft_widths": [1, 4, 16],
            "draft_level_s": [0.01, 0.012, 0.02], "step_residual_s": 0.001,
            "draft_level_greedy_s": [0.01, 0.012, 0.02], "step_residual_greedy_s": 0.001,
            "measured_at": "2026-12-02T00:00:00Z", "measure_s": 12.0, "kind": "measured", "fit_budgets": [1, 8],
            "fit_depths": [1, 3], "fit_step_s": [0.1, 0.2], "fit_step_greedy_s": [0.1, 0.2]}


def build_profile(folder: Path, draw=None) -> Path:
    """measured.json (a MeasuredProfile) or gpu.json (a GpuSpec), damaged."""
    from offload_engine.planning.hw_profile import GPU_DIR
    kind = "measured" if draw is None or draw(st.booleans()) else "gpu"
    doc = base_measured() if kind == "measured" else json.loads((GPU_DIR / "rtx4090.json").read_text())
    keys = list(doc) + ["vram_gb", "stream_gb_per_ms", "unknown_field", "target_pass_ms"]
    data = json.dumps(doc).encode() if draw is None else json_bytes(draw, doc, keys)
    path = folder / f"{kind}.json"
    path.write_bytes(data)
    return path


def profile_sweep() -> list:
    from offload_engine.planning.hw_profile import GPU_DIR

    def writer(name):
        def write(folder: Path, data: bytes) -> Path:
            (folder / name).write_bytes(data)
            return folder / name
        return write
    values = [10**400, float("nan"), -1, 0, "1", [], None]
    gpu = json.loads((GPU_DIR / "rtx4090.json").read_text())
    return (json_sweep(base_measured(), writer("measured.json"), list(base_measured()), values)
            + json_sweep(gpu, writer("gpu.json"), list(gpu), values))


def acceptance_sweep() -> list:
    def write(folder: Path, data: bytes) -> Path:
        (folder / "store").mkdir()
        (folder / "store" / "vector.json").write_bytes(data)
        return folder / "store" / "vector.json"
    base = {"acceptance": [0.5, 0.2, 0.1], "temperature": 0.0, "target_fingerprint": "0123456789abcdef",
            "draft_key": "self-int8"}
    return json_sweep(base, write, ["acceptance", ("acceptance", 0), "temperature"])


def build_acceptance(folder: Path, draw=None) -> Path:
    """store/vector.json: an acceptance vector as the `acceptance` command writes it, damaged (or
    a folder where the file should be)."""
    store = folder / "store"
    store.mkdir()
    doc = {"acceptance": [0.5, 0.2, 0.1], "mode": "on-policy", "width": 3, "temperature": 0.0,
           "target_fingerprint": "0123456789abcdef", "draft_key": "self-int8"}
    path = store / "vector.json"
    if draw is not None and draw(st.integers(0, 15)) == 0:
        path.mkdir()
        return path
    path.write_bytes(json.dumps(doc).encode() if draw is None else
                     json_bytes(draw, doc, ["acceptance", "temperature", "note"]))
    return path


# ---- Ollama manifests ---------------------------------------------------------------------------

DIGEST = "sha256:" + "ab" * 32


def ollama_sweep() -> list:
    def write(folder: Path, data: bytes) -> Path:
        manifest = build_ollama(folder)
        manifest.write_bytes(data)
        return manifest
    base = {"schemaVersion": 2, "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": DIGEST}]}
    return json_sweep(base, write, ["layers", ("layers", 0), ("layers", 0, "mediaType"), ("layers", 0, "digest")])


def build_ollama(folder: Path, draw=None) -> Path:
    """An Ollama models folder (manifest + blob) whose manifest, or blob, is damaged; returns the
    manifest."""
    manifest = folder / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    (folder / "blobs").mkdir()
    doc = {"schemaVersion": 2, "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": DIGEST,
                                           "size": 8}, {"mediaType": "application/vnd.ollama.image.license"}]}
    blob = b"GGUF\x03\0\0\0"
    if draw is not None and draw(st.integers(0, 4)) == 0:
        blob = draw(st.sampled_from([b"", b"GGU", b"\x7fELF", None]))
    if blob is not None:
        (folder / "blobs" / DIGEST.replace(":", "-")).write_bytes(blob)
    manifest.write_bytes(json.dumps(doc).encode() if draw is None else
                         json_bytes(draw, doc, ["layers", "mediaType", "digest"]))
    return manifest
