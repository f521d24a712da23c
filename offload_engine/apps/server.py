"""An OpenAI-compatible HTTP server (`sequoia-offload serve`) on FastAPI and uvicorn.

One model on one GPU runs one generation at a time. Requests wait in a bounded FIFO queue
(`Scheduler`); a full queue answers 429. A single worker thread owns the engine, so the event
loop never blocks on a forward pass. Tokens travel from the worker to the request's coroutine
through an asyncio queue; a client that disconnects (streaming or not) sets its job's cancel
event, which stops the generation at the next layer boundary (or drops it from the queue), so
the engine is free for the next request at once. Every error is OpenAI's error object.

Prefix reuse comes from the engine: a conversation's next turn extends the previous prompt and
answer, so only the new message is prefilled (reported as usage.prompt_tokens_details.cached_tokens).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine import Engine, GenerationResult
from ..errors import GenerationCancelled, UserError

DEFAULT_MAX_QUEUE = 16
KEEPALIVE_S = 10.0  # a stream waiting in the queue or on a long pass sends an SSE comment this often
MAX_STOP_STRINGS = 4
ROLES = {"system", "developer", "user", "assistant"}
WEB_DIR = Path(__file__).parent / "web"  # the chat page at /: plain files, no build step, nothing from a CDN
WEB_FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
             "chat.css": "text/css; charset=utf-8"}
WEB_HEADERS = {  # only this server's own script, style and API; no framing, no inline script
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the offending parameter and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                              429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# ---- request parsing ----------------------------------------------------------------------------

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
    except UserError as e:  # the checkpoint's template refused these messages (e.g. roles out of order)
        raise bad(str(e), "messages") from None
    req = _common(body, engine, model_name, ids, default_max=engine.max_context, prompt_param="messages")
    # the conversation: its messages up to the first user message (the same in every later turn)
    first_user = next((i for i, m in enumerate(clean) if m["role"] == "user"), len(clean) - 1)
    req.conversation = _digest(req.user, json.dumps(clean[:first_user + 1]))
    return req


def parse_completion(body: dict, engine: Engine, model_name: str) -> GenRequest:
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


# ---- the queue and the worker -------------------------------------------------------------------

@dataclass
class Job:
    """One request's generation. Events for its coroutine: ("text", str), ("done", result),
    ("cancelled", None), ("error", ApiError)."""
    request: GenRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    key: object = None  # the suffix drafts' store key: the API key's index, or the conversation

    def push(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (the server is shutting down)
            pass


class Scheduler:
    """A bounded FIFO queue in front of one worker thread that owns the engine."""

    def __init__(self, engine: Engine, max_queue: int, suffix_shared: bool = False):
        self.engine, self.max_queue, self.suffix_shared = engine, max_queue, suffix_shared
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closed = False
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self._thread = threading.Thread(target=self._work, name="generation-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the engine busy and max_queue waiting)."""
        with self._cond:
            # one generating (or about to: the worker may not have woken yet) plus max_queue waiting
            if self._closed or len(self._waiting) + (self._running is not None) > self.max_queue:
                self.counts["rejected"] += 1
                return False
            self._waiting.append(job)
            self._cond.notify()
            return True

    def withdraw(self, job: Job) -> None:
        """A client went away: drop its job from the queue, or stop it if it is running."""
        job.cancel.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1
                job.finished = True
                job.push("cancelled", None)  # ends the request's coroutine, which waits for its events

    def status(self) -> dict:
        with self._cond:
            return {"busy": self._running is not None, "waiting": len(self._waiting), "max_queue": self.max_queue,
                    **self.counts}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in self._waiting:
                job.cancel.set()
                job.finished = True
                job.push("cancelled", None)
            self._waiting.clear()
            self._cond.notify_all()
        if self._running is not None:
            self._running.cancel.set()
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
            try:
                outcome, event = "completed", ("done", self._generate(job))
            except GenerationCancelled:
                outcome, event = "cancelled", ("cancelled", None)
            except UserError as e:
                outcome, event = "failed", ("error", bad(str(e)))
            except Exception as e:  # a bug or a device failure: report it, keep serving
                traceback.print_exc(file=sys.stderr)
                outcome, event = "failed", ("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}"))
            with self._cond:  # the engine is free and counted before the client hears the end
                self._running = None
                self.counts[outcome] += 1
                job.finished = True
            job.push(*event)

    def _generate(self, job: Job) -> GenerationResult:
        r = job.request
        key = None if self.suffix_shared else job.key

        def on_token(token_id: int, text: str) -> None:
            if text:
                job.push("text", text)

        return self.engine.generate(input_ids=r.ids, max_new_tokens=r.max_tokens, temperature=r.temperature,
                                    top_p=r.top_p, top_k=r.top_k, seed=r.seed, stop=r.stop or None,
                                    on_token=on_token if r.stream else None, cancel=job.cancel, suffix_key=key)


# ---- the app ------------------------------------------------------------------------------------

def _usage(result: GenerationResult) -> dict:
    s = result.stats
    return {"prompt_tokens": s["prompt_tokens"], "completion_tokens": s["new_tokens"],
            "total_tokens": s["prompt_tokens"] + s["new_tokens"],
            "prompt_tokens_details": {"cached_tokens": s["cached_prompt_tokens"]}}


def _extra(result: GenerationResult) -> dict:
    """sequoia-offload's own figures, beside OpenAI's fields (clients ignore unknown keys)."""
    s = result.stats
    return {"tokens_per_second": s["tokens_per_second"], "tokens_per_step": s["tokens_per_step"],
            "target_passes": s["target_passes"], "tree": s["tree"], "prefill_seconds": s["prefill_seconds"],
            "prefilled_tokens": s["prefilled_tokens"],
            "trees": s["auto"]["trees"] if s.get("auto") else None,  # --tree auto: the trees its steps used
            "suffix": ({k: s["suffix"][k] for k in ("accepted_tokens", "matched_steps", "store_matched_steps")}
                       if s.get("suffix") else None)}  # --draft ...suffix: what its drafts gave


def create_app(engine: Engine, model_name: str, api_key: str | list[str] | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, cors_origins: list[str] | None = None, suffix_shared: bool = False):
    """The FastAPI app serving `engine` as `model_name`; its scheduler is app.state.scheduler.
    `cors_origins` lets browser pages from those origins call it (none by default). `api_key`: one
    key or several (each client its own). With suffix drafts, each API key (or, with no keys, each
    conversation) drafts only from its own earlier requests, since a step's latency would tell one
    client whether another's text matched; `suffix_shared` pools them."""
    if max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {max_queue}")
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not k for k in keys):
        raise UserError("an API key must not be empty")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        app.state.scheduler = Scheduler(engine, max_queue, suffix_shared)
        try:
            yield
        finally:
            app.state.scheduler.close()

    app = FastAPI(title="sequoia-offload", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    def error(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        message = "no such route: " + request.url.path if e.status_code == 404 else str(e.detail)
        return error(ApiError(e.status_code, message, type_="invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return error(bad(f"invalid request: {e}"))

    def authorize(request: Request) -> int | None:
        """The index of the request's API key (None when the server has none)."""
        if not keys:
            return None
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not given:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' (this server was started with "
                           "--api-key)", code="invalid_api_key")
        found = None
        for i, key in enumerate(keys):  # every key compared, in constant time each
            if secrets.compare_digest(given.encode(), key.encode()):
                found = i
        if found is None:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        return found

    async def read_body(request: Request) -> dict:
        request.state.key_index = authorize(request)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    def static_page(body: bytes, media_type: str):
        async def page() -> Response:  # (no parameters: nothing a request sends reaches the response)
            return Response(body, media_type=media_type, headers=WEB_HEADERS)
        return page

    for name, media_type in WEB_FILES.items():  # read once, served from memory
        app.add_api_route("/" if name == "index.html" else "/" + name,
                          static_page((WEB_DIR / name).read_bytes(), media_type), methods=["GET"],
                          include_in_schema=False)

    @app.get("/health")
    async def health(request: Request):
        return {"status": "ok", "model": model_name, **request.app.state.scheduler.status()}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "sequoia-offload",
                                            "context_length": engine.max_context}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        authorize(request)
        if name != model_name:
            raise ApiError(404, f"the model '{name}' does not exist here; this server serves '{model_name}'",
                           "model", "model_not_found")
        return {"id": model_name, "object": "model", "created": created, "owned_by": "sequoia-offload"}

    async def watch_disconnect(request: Request, scheduler: Scheduler, job: Job) -> None:
        """Cancel the job when the client goes away (the request body is already read, so the
        next ASGI message is the disconnect)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if not job.finished:
                    scheduler.withdraw(job)
                return

    async def run(request: Request, req: GenRequest, chat: bool):
        scheduler: Scheduler = request.app.state.scheduler
        index = request.state.key_index
        # suffix drafts' store: per API key (and end user), else per conversation
        key = ("key", index, req.user) if index is not None else ("conversation", req.conversation)
        job = Job(req, asyncio.get_running_loop(), key=key)
        if not scheduler.submit(job):
            raise ApiError(429, f"the server is busy: {scheduler.max_queue} requests are already waiting "
                           "(--max-queue); retry shortly", code="queue_full")
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            return StreamingResponse(stream(request, scheduler, job, ident, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.create_task(watch_disconnect(request, scheduler, job))
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "done":
                    break
                if kind == "error":
                    raise value
                if kind == "cancelled":  # only when the client is gone: nobody reads this
                    raise ApiError(499, "cancelled", type_="cancelled")
        finally:
            watcher.cancel()
            if not job.finished:
                scheduler.withdraw(job)
        result: GenerationResult = value
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "system_fingerprint": "sequoia-offload", "choices": [choice],
                "usage": _usage(result), "sequoia": _extra(result)}

    async def stream(request: Request, scheduler: Scheduler, job: Job, ident: str, chat: bool) -> AsyncIterator[str]:
        created_at = int(time.time())
        kind_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            body = {"id": ident, "object": kind_name, "created": created_at, "model": model_name,
                    "system_fingerprint": "sequoia-offload", "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        def piece(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        watcher = asyncio.create_task(watch_disconnect(request, scheduler, job))
        try:
            if chat:
                yield chunk([piece(None, None, first=True)])
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:  # queued, or a long pass: keep the connection (and proxies) alive
                    yield ": keep-alive\n\n"
                    continue
                if kind == "text":
                    yield chunk([piece(value, None)])
                elif kind == "done":
                    yield chunk([piece(None, value.finish_reason)])
                    if job.request.include_usage:
                        yield chunk([], usage=_usage(value), sequoia=_extra(value))
                    break
                elif kind == "error":
                    yield f"data: {json.dumps(value.body())}\n\n"
                    break
                else:  # cancelled: the client is gone
                    return
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not job.finished:
                scheduler.withdraw(job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, parse_chat(await read_body(request), engine, model_name), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, parse_completion(await read_body(request), engine, model_name), chat=False)

    return app


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | list[str] | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
          cors_origins: list[str] | None = None, log_level: str = "info", suffix_shared: bool = False) -> None:
    """Run the server until Ctrl-C (`sequoia-offload serve`)."""
    import uvicorn
    app = create_app(engine, model_name, api_key, max_queue, cors_origins, suffix_shared)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"sequoia-offload: warning: serving on {host} without --api-key: anyone who can reach this "
              "machine can use the model", file=sys.stderr)
    print(f"sequoia-offload: serving '{model_name}' at http://{host}:{port}/v1 (OpenAI API; Ctrl-C stops)",
          file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
