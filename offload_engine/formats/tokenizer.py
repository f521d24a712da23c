"""Tokenizer (tokenizer.json through `tokenizers`) and chat template (sandboxed jinja2)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ..errors import UserError
from .config import read_json_object


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str):
    raise TemplateError(message)


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
        self._template = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"{folder}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception
            raise UserError(f"{path}: cannot load tokenizer ({e})") from None
        config_path = folder / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        template_path = folder / "chat_template.jinja"
        if template_path.is_file() and not config.get("chat_template"):
            config["chat_template"] = template_path.read_text(encoding="utf-8")
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
        """Render the checkpoint's chat template in a sandbox (no file, attribute or import access)."""
        if not self.chat_template:
            raise UserError(f"{self.source}: the checkpoint has no chat template "
                            "(tokenizer_config.json 'chat_template'); use a plain prompt instead of --chat")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as e:
                raise UserError(f"{self.source}: chat template does not parse ({e})") from None
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except Exception as e:  # the template is the checkpoint's code: any failure is its input's fault
            raise UserError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The template writes BOS and control tokens itself, so no special tokens are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
