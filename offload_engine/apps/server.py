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
import ipaddress
import json
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..engine import Engine, GenerationResult
from ..errors import DataError, GenerationCancelled, UserError
from ..runtime.threads import release_thread_team
from .http_guards import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimits, header_deadline_protocol
from .openai_requests import ApiError, GenRequest, bad, parse_chat, parse_completion

DEFAULT_MAX_QUEUE = 16
KEEPALIVE_S = 10.0  # a stream waiting in the queue or on a long pass sends an SSE comment this often
WEB_DIR = Path(__file__).parent / "web"  # the chat page at /: plain files, no build step, nothing from a CDN
WEB_FILES = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
             "chat.css": "text/css; charset=utf-8"}
WEB_HEADERS = {  # only this server's own script, style and API; no framing, no inline script
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


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
        # the worker computes from now on: this thread (which loaded the engine) frees its OpenMP
        # team, or the worker's matmuls would run at half speed on a CPU (runtime/threads.py)
        release_thread_team()
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
            except DataError as e:  # the server's own store or disk: not the request's fault
                print(f"sequoia-offload: error: {e}", file=sys.stderr)
                outcome, event = "failed", ("error", ApiError(503, f"the server cannot read its model: {e}",
                                                              type_="server_error", code="model_unreadable"))
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
            if outcome == "completed" and not self._closed:  # --draft auto: another draft, where this run
                self.engine.after_answer()  # says it wins, once the client has the answer (the next waits)

    def _generate(self, job: Job) -> GenerationResult:
        r = job.request
        key = None if self.suffix_shared else job.key

        def on_token(token_id: int, text: str) -> None:
            if text:
                job.push("text", text)

        return self.engine.generate(input_ids=r.ids, max_new_tokens=r.max_tokens, temperature=r.temperature,
                                    top_p=r.top_p, top_k=r.top_k, seed=r.seed, stop=r.stop or None,
                                    on_token=on_token if r.stream else None, cancel=job.cancel, suffix_key=key,
                                    switch=False)


# ---- the app ------------------------------------------------------------------------------------

def check_limits(max_queue: int, max_body_bytes: int, body_timeout_s: float) -> None:
    if max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {max_queue}")
    if max_body_bytes < 1:
        raise UserError(f"--max-body must be at least 1 byte, got {max_body_bytes}")
    if not body_timeout_s > 0:
        raise UserError(f"--body-timeout must be more than 0 seconds, got {body_timeout_s}")


def check_bind(host: str, api_key, insecure_no_key: bool) -> bool:
    """Refuse to serve other machines without a key (anyone who can reach this one could use the
    model) unless `insecure_no_key`; True when serving them without one."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    exposed = not (loopback or api_key)
    if exposed and not insecure_no_key:
        raise UserError(f"--host {host} lets other machines connect: give --api-key KEY (or SEQUOIA_OFFLOAD_API_KEY), "
                        "or --insecure-no-key to serve them without one")
    return exposed


async def json_body(request: Request) -> dict:
    """The request's JSON object: sent as application/json (a browser page from another origin cannot
    send that without asking first, as it can send text/plain), within `BodyLimits`, parsed."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"the request body must be sent as 'Content-Type: application/json', got "
                       f"{media_type[:80] or 'none'!r}", code="unsupported_media_type")
    try:
        raw = await request.body()
    except ClientDisconnect:  # nobody will read the answer
        raise ApiError(499, "the client went away", type_="cancelled") from None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also an integer of 4,301+ digits
        raise bad(f"the request body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


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
               max_queue: int = DEFAULT_MAX_QUEUE, cors_origins: list[str] | None = None, suffix_shared: bool = False,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
    """The FastAPI app serving `engine` as `model_name`; its scheduler is app.state.scheduler.
    `cors_origins` lets browser pages from those origins call it (none by default). `api_key`: one
    key or several (each client its own). With suffix drafts, each API key (or, with no keys, each
    conversation) drafts only from its own earlier requests, since a step's latency would tell one
    client whether another's text matched; `suffix_shared` pools them. A request body over
    `max_body_bytes`, or slower than `body_timeout_s`, is refused (`BodyLimits`)."""
    check_limits(max_queue, max_body_bytes, body_timeout_s)
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
    app.add_middleware(BodyLimits, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
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
        request.state.key_index = authorize(request)  # (before a byte of the body is read)
        return await json_body(request)

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
        # in a thread: a long prompt's tokens, or a chat template's render, must not stall other clients
        return await run(request, await asyncio.to_thread(parse_chat, await read_body(request), engine, model_name),
                         chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, await asyncio.to_thread(parse_completion, await read_body(request), engine,
                                                          model_name), chat=False)

    return app


def uvicorn_settings(body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> dict:
    """uvicorn's settings: h11 with a deadline on each request's headers (`body_timeout_s`)."""
    return {"http": header_deadline_protocol(body_timeout_s), "timeout_graceful_shutdown": 5}


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | list[str] | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
          cors_origins: list[str] | None = None, log_level: str = "info", suffix_shared: bool = False,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
          insecure_no_key: bool = False) -> None:
    """Run the server until Ctrl-C (`sequoia-offload serve`)."""
    exposed = check_bind(host, api_key, insecure_no_key)
    app = create_app(engine, model_name, api_key, max_queue, cors_origins, suffix_shared, max_body_bytes,
                     body_timeout_s)
    if exposed:
        print(f"sequoia-offload: warning: serving on {host} without --api-key (--insecure-no-key): anyone who can "
              "reach this machine can use the model", file=sys.stderr)
    print(f"sequoia-offload: serving '{model_name}' at http://{host}:{port}/v1 (OpenAI API; Ctrl-C stops)",
          file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, **uvicorn_settings(body_timeout_s))
