"""Tokenizer (tokenizer.json through `tokenizers`) and chat template (sandboxed jinja2 in a worker process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from ..errors import DataError, UserError
from .config import read_json_object
from .template_sandbox import TemplateFailure, shared_sandbox


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _rust_error(e: BaseException) -> bool:
    """An error of the tokenizers library: a bare Exception, or a panic (pyo3's PanicException,
    which is a BaseException)."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def _check_works(path: Path, tok: HFTokenizer) -> None:
    """The tokenizer encodes and decodes a sample text. A post-processor template that names a
    special token it does not define loads, then panics on every encode (printing the panic):
    that is checked in its JSON first."""
    proc = tok.post_processor
    data = json.loads(proc.__getstate__()) if proc is not None else {}
    for part in data.get("processors") or [data]:
        if not isinstance(part, dict) or part.get("type") != "TemplateProcessing":
            continue
        for piece in part.get("single", []) + part.get("pair", []):
            name = piece.get("SpecialToken", {}).get("id") if isinstance(piece, dict) else None
            if name is not None and name not in (part.get("special_tokens") or {}):
                raise UserError(f"{path}: the post_processor's template names the special token {name!r}, "
                                "which its special_tokens do not define")
    try:
        tok.decode(tok.encode("Hello, world! 123\n").ids)
    except BaseException as e:
        if not _rust_error(e):
            raise
        raise UserError(f"{path}: the tokenizer fails on a sample text ({' '.join(str(e).split())[:300]})") from None


def _checked_config(path: Path, config: dict) -> dict:
    """tokenizer_config.json's special tokens and chat template have the types __init__ reads."""
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, dict) and isinstance(value.get("content"), str)):
            raise UserError(f"{path}: {key} must be text or {{\"content\": text}}, got {repr(value)[:60]}")
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str) and not (isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) and isinstance(t.get("name"), (str, type(None)))
            for t in template)):
        raise UserError(f"{path}: chat_template must be text or a list of {{\"name\", \"template\"}} objects, "
                        f"got {repr(template)[:60]}")
    return config


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict, source: Path):
        self.tok = tokenizer
        self.source = source
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"{folder}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except BaseException as e:
            if not _rust_error(e):
                raise
            raise UserError(f"{path}: cannot load tokenizer ({' '.join(str(e).split())[:300]})") from None
        _check_works(path, tok)
        config_path = folder / "tokenizer_config.json"
        config = _checked_config(config_path, read_json_object(config_path) if config_path.is_file() else {})
        template_path = folder / "chat_template.jinja"
        if template_path.is_file() and not config.get("chat_template"):
            try:
                config["chat_template"] = template_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"{template_path}: cannot read the chat template ({e})") from None
        return cls(tok, config, folder)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special and control tokens written in the text become their single ids."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the checkpoint's chat template in a sandbox: no attribute, file or import
        access (jinja2's immutable sandbox), within a time and a memory bound (a worker process,
        `template_sandbox`)."""
        if not self.chat_template:
            raise UserError(f"{self.source}: the checkpoint has no chat template "
                            "(tokenizer_config.json 'chat_template'); use a plain prompt instead of --chat")
        context = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        try:
            return shared_sandbox().render(self.chat_template, context)
        except TemplateFailure as e:  # the template is the checkpoint's code: any failure is its input's fault
            if e.kind == "syntax":
                raise UserError(f"{self.source}: chat template {e}") from None
            if e.kind in ("timeout", "crash", "start"):  # the model's or the machine's, not the messages'
                raise DataError(f"{self.source}: chat template {e}") from None
            raise UserError(f"{self.source}: chat template failed on these messages: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The template writes BOS and control tokens itself, so no special tokens are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
