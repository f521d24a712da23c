"""OpenAI's request bodies for chat and completions, checked in OpenAI's terms: a `GenRequest`
(the prompt's token ids and the sampling settings) or an `ApiError` with OpenAI's error object
(status, message, type, param, code) that names the field at fault. Unknown fields are refused as
OpenAI refuses them; every field the official client can send is known here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import Engine
from ..errors import DataError, UserError

MAX_STOP_STRINGS = 4
ROLES = {"system", "developer", "user", "assistant"}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the offending parameter and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("rate_limit_error" if status == 429 else "invalid_request_error" if status < 500
                              else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# Every field the official `openai` client (3.57) can send, by endpoint, plus this server's `top_k`;
# fields with settings this server does not do are refused by name in the parsers below
CHAT_FIELDS = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options", "top_k"})
COMPLETION_FIELDS = frozenset({
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n", "presence_penalty",
    "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "top_k"})


def check_fields(body: dict, known: frozenset[str]) -> None:
    """OpenAI's answer to a field it does not know (a typo would otherwise be silently ignored)."""
    for name in body:
        if name not in known:
            raise bad(f"Unrecognized request argument supplied: {name[:80]}", name[:80])

_NUMBER = (int, float)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, _NUMBER) and not isinstance(x, bool)


@dataclass
class GenRequest:
    """A checked request: the prompt's token ids and the sampling settings."""
    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    user: str = ""  # OpenAI's end-user id, when the client sends one
    conversation: str = ""  # a digest of the conversation's opening (and the user)


def _optional(body: dict, name: str, check: Callable[[object], bool], what: str, default):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(f"'{name}' must be {what}, got {json.dumps(value)[:80]}", name)
    return value


def _common(body: dict, engine: Engine, model_name: str, ids: list[int], default_max: int,
            prompt_param: str) -> GenRequest:
    """The settings chat and completions share, checked in OpenAI's terms."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required (a string); GET /v1/models lists the served model", "model")
    if model != model_name:
        raise bad(f"the model '{model}' does not exist here; this server serves '{model_name}'", "model",
                  "model_not_found")
    n = _optional(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise bad(f"'n' must be 1 (one model on one GPU generates one answer at a time), got {n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _optional(body, name, _is_number, "a number", 0)
        if value != 0:
            raise bad(f"'{name}' is not supported (it would change the model's distribution); send 0 or leave it out",
                      name)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad("'logprobs' is not supported", "logprobs")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias")
    temperature = _optional(body, "temperature", _is_number, "a number", 1.0)
    if not 0 <= temperature <= 2:
        raise bad(f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    top_p = _optional(body, "top_p", _is_number, "a number", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _optional(body, "top_k", _is_int, "an integer", 0)
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0, got {top_k}", "top_k")
    seed = _optional(body, "seed", _is_int, "an integer", None)
    if seed is not None and not 0 <= seed < 2**63:
        raise bad(f"'seed' must be in 0..2**63-1, got {seed}", "seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    stream = _optional(body, "stream", lambda x: isinstance(x, bool), "true or false", False)
    options = _optional(body, "stream_options", lambda x: isinstance(x, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be true or false", "stream_options")
    room = engine.max_context - len(ids)
    if room < 1:
        raise bad(f"the prompt has {len(ids)} tokens; this model's context holds {engine.max_context} "
                  "(--max-context), with room for at least one new token", prompt_param, "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _optional(body, name, _is_int, "an integer", min(default_max, room))
    if not 1 <= max_tokens <= room:
        raise bad(f"'{name}' must be between 1 and {room} (the context's {engine.max_context} tokens minus the "
                  f"prompt's {len(ids)}), got {max_tokens}", name,
                  "context_length_exceeded" if max_tokens > room else None)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user")
    return GenRequest(ids, max_tokens, float(temperature), float(top_p), top_k, seed, stop, stream, include_usage,
                      user or "")


def _content_text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined); images are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content: only text parts are supported, got {kind!r}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", "messages")


def parse_chat(body: dict, engine: Engine, model_name: str) -> GenRequest:
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad("'messages' is required: a list of {role, content} objects", "messages")
    if not messages:
        raise bad("'messages' is empty: send at least one message", "messages")
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none", "auto"):
        raise bad("tools and function calling are not supported by this server", "tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {json.dumps(role)}", "messages")
        if m.get("tool_calls"):
            raise bad(f"{where}: tool calls are not supported", "messages")
        clean.append({"role": "system" if role == "developer" else role,
                      "content": _content_text(m.get("content"), where)})
    try:
        ids = engine.tokenizer.encode_chat(clean)
    except DataError as e:  # the template hung or killed its worker: the server's model, not the request
        raise ApiError(503, f"the server cannot render its chat template: {e}", code="template_failed") from None
    except UserError as e:  # the checkpoint's template refused these messages (e.g. roles out of order)
        raise bad(str(e), "messages") from None
    req = _common(body, engine, model_name, ids, default_max=engine.max_context, prompt_param="messages")
    # the conversation: its messages up to the first user message (the same in every later turn)
    first_user = next((i for i, m in enumerate(clean) if m["role"] == "user"), len(clean) - 1)
    req.conversation = _digest(req.user, json.dumps(clean[:first_user + 1]))
    return req


def parse_completion(body: dict, engine: Engine, model_name: str) -> GenRequest:
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        vocab = engine.config.vocab_size
        bad_ids = [t for t in prompt if not 0 <= t < vocab]
        if bad_ids:
            raise bad(f"'prompt' token {bad_ids[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad(f"'prompt' must be one prompt (batches are not supported), got {len(prompt)}", "prompt")
    else:
        raise bad("'prompt' is required: a string or a list of token ids", "prompt")
    if not ids:
        raise bad("'prompt' is empty (no tokens)", "prompt")
    for name, allowed in (("echo", (None, False)), ("suffix", (None, "")), ("best_of", (None, 1))):
        if body.get(name) not in allowed:
            raise bad(f"'{name}' is not supported", name)
    req = _common(body, engine, model_name, ids, default_max=16, prompt_param="prompt")  # 16: OpenAI's default
    req.conversation = _digest(req.user, json.dumps(ids[:CONVERSATION_TOKENS]))  # its opening tokens
    return req


CONVERSATION_TOKENS = 32  # a completions prompt's conversation: its first tokens (a transcript grows after them)


def _digest(user: str, opening: str) -> str:
    return hashlib.sha256(json.dumps([user, opening]).encode()).hexdigest()
