"""Rebuild tokenizer.json from a GGUF file's tokenizer metadata.

A GGUF stores its tokenizer as metadata: tokens, merges (BPE) or scores (SentencePiece), token
types, and only the *name* of a pre-tokenizer. llama.cpp (src/llama-vocab.cpp) maps each name to
split rules; the same rules are written here as `tokenizers` pre-tokenizers, so that the ids are
the ones the model was trained with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .gguf_check import meta_list, shown

# llama.cpp src/llama-vocab.cpp: pre-tokenizer name -> split regexes (applied in order, each one
# splitting the pieces the previous ones left; text no regex matches stays a piece of its own).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp spells the contractions with explicit case classes instead of (?i:...) (which in
# Oniguruma would also fold e.g. U+017F LONG S onto 's'); we follow llama.cpp.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# name -> (kind, regexes, ignore_merges, default add_bos)
_PRE_TOKENIZERS: dict[str, tuple[str, tuple[str, ...], bool, bool]] = {}


def _register(names: str, kind: str, regexes: tuple[str, ...] = (), ignore_merges: bool = False,
              add_bos: bool = False) -> None:
    for n in names.split():
        _PRE_TOKENIZERS[n] = (kind, regexes, ignore_merges, add_bos)


_register("smollm starcoder refact command-r codeshell exaone minerva minerva-7b", "digits+gpt2")
_register("gpt2 gpt-2 phi-2 mpt olmo jais exaone4 trillion granite-docling mellum a.x-4.0 gigachat", "gpt2")
_register("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", "split", (_LLAMA3_RE,),
          ignore_merges=True, add_bos=True)
_register("dbrx smaug-bpe", "split", (_LLAMA3_RE,))
_register("qwen2 deepseek-r1-qwen kormo megrez stablelm2 hunyuan", "split", (_QWEN2_RE,))
_register("falcon", "split", (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE + r"|\s+", r"[0-9][0-9][0-9]"))
_register("default", "split", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE + r"|\s+", r"\p{N}+", r"[0-9][0-9][0-9]"))

KNOWN_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))


def _bpe_pre_tokenizer(kind: str, regexes: tuple[str, ...]):
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    if kind == "gpt2":
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pt.Sequence([pt.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
                       + [pt.ByteLevel(add_prefix_space=False, use_regex=False)])


def _template(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None) -> dict:
    """A TemplateProcessing post-processor as JSON (the Python constructor chokes on ':' in names)."""
    def special(tok, type_id):
        return {"SpecialToken": {"id": tok, "type_id": type_id}}

    def seq(name, type_id):
        return {"Sequence": {"id": name, "type_id": type_id}}

    single, pair, specials = [], [], {}
    if bos is not None:
        single.append(special(bos, 0))
        pair.append(special(bos, 0))
        specials[bos] = {"id": bos, "ids": [bos_id], "tokens": [bos]}
    single.append(seq("A", 0))
    pair.append(seq("A", 0))
    if eos is not None:
        single.append(special(eos, 0))
        pair.append(special(eos, 0))
        specials[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    if bos is not None:
        pair.append(special(bos, 1))
    pair.append(seq("B", 1))
    if eos is not None:
        pair.append(special(eos, 1))
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}


def spm_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two pieces of the
    vocabulary, ordered by the merged piece's score (highest first) -- the order in which llama.cpp's
    SPM tokenizer applies them."""
    found = []
    for i, piece in enumerate(tokens):
        if vocab.get(piece) != i:
            continue  # a duplicate spelling; the vocabulary maps it to another id
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((-float(scores[i]), i, vocab[left], vocab[right], left, right))
    found.sort(key=lambda x: x[:4])
    return [(f[4], f[5]) for f in found]


@dataclass
class TokenizerBuild:
    tokenizer_json: str
    bos: str | None
    eos: str | None
    unk: str | None
    pad: str | None
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    eos_ids: list[int]
    add_bos: bool
    add_eos: bool


def build_tokenizer(path: Path, meta: dict) -> TokenizerBuild:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise UserError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.model is missing)")
    if model not in ("gpt2", "llama"):
        raise UserError(f"{path}: tokenizer model {model!r} is not supported (supported: gpt2, llama)")
    tokens = meta_list(path, meta, "tokenizer.ggml.tokens", str)
    if not tokens:
        raise UserError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    # llama.cpp renames empty tokens so that every id has a distinct, non-empty spelling.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    n = len(tokens)
    types = meta_list(path, meta, "tokenizer.ggml.token_type", int) or [1] * n
    if len(types) != n:
        raise UserError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}  # like llama.cpp, a repeated spelling maps to its last id

    def tok_id(key: str, default: int | None) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}", default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
            raise UserError(f"{path}: tokenizer.ggml.{key} = {shown(v)} is outside the vocabulary (0..{n - 1})")
        return v

    spm = model == "llama"
    bos_id = tok_id("bos_token_id", 1 if spm else None)
    eos_id = tok_id("eos_token_id", 2 if spm else None)
    unk_id = tok_id("unknown_token_id", 0 if spm else None)
    pad_id = tok_id("padding_token_id", None)
    eos_ids = [eos_id] if eos_id is not None else []
    for key in ("eot_token_id", "eom_token_id"):
        extra = tok_id(key, None)
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)

    if spm:
        scores = meta_list(path, meta, "tokenizer.ggml.scores", (int, float))
        if len(scores) != n:
            raise UserError(f"{path}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        if unk_id is None:
            unk_id = next((i for i, t in enumerate(types) if t == 2), None)
        bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, vocab),
                         unk_token=tokens[unk_id] if unk_id is not None else None,
                         fuse_unk=True, byte_fallback=True)
        tok = Tokenizer(bpe)
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        norm = [normalizers.Replace(" ", "\u2581")]
        if add_prefix:
            norm.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(norm)
        tok.pre_tokenizer = None
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            dec.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(dec)
        default_bos = True
        post_bytelevel = None
    else:
        pre = meta.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str) or pre not in _PRE_TOKENIZERS:
            raise UserError(f"{path}: pre-tokenizer {shown(pre)} (tokenizer.ggml.pre) is not supported; known: "
                            f"{', '.join(KNOWN_PRE_TOKENIZERS)}")
        kind, regexes, ignore_merges, default_bos = _PRE_TOKENIZERS[pre]
        merges = []
        for j, m in enumerate(meta_list(path, meta, "tokenizer.ggml.merges", str)):
            cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if cut < 0:
                raise UserError(f"{path}: tokenizer.ggml.merges[{j}] = {m!r} is not two tokens separated by a space")
            merges.append((m[:cut], m[cut + 1:]))
        if not merges:
            raise UserError(f"{path}: tokenizer.ggml.merges is missing or empty for a gpt2 (BPE) tokenizer")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        tok.normalizer = None
        tok.pre_tokenizer = _bpe_pre_tokenizer(kind, regexes)
        tok.decoder = decoders.ByteLevel()
        post_bytelevel = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}

    # Control tokens (3) and the unknown token (2) are special; user-defined ones (4) are matched
    # whole in the raw text too (as llama.cpp does) but are ordinary text when decoding.
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                if ty in (2, 3)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
    if specials:
        tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    data = json.loads(tok.to_str())
    procs = [post_bytelevel] if post_bytelevel else []
    if add_bos or add_eos:
        procs.append(_template(tokens[bos_id] if add_bos else None, bos_id if add_bos else None,
                               tokens[eos_id] if add_eos else None, eos_id if add_eos else None))
    data["post_processor"] = None if not procs else procs[0] if len(procs) == 1 else {
        "type": "Sequence", "processors": procs}
    text = json.dumps(data, ensure_ascii=False, indent=2)
    Tokenizer.from_str(text)  # the file must load back

    def name(i):
        return tokens[i] if i is not None else None

    return TokenizerBuild(text, name(bos_id), name(eos_id), name(unk_id), name(pad_id),
                           bos_id, eos_id, pad_id, eos_ids, add_bos, add_eos)
