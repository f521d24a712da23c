"""The chat-template worker: a small child process that renders a checkpoint's jinja2 chat template.

A chat template is code that comes with a downloaded model. Jinja's sandbox stops it reaching
attributes, files and imports, but not looping for hours or asking for a 10 GB string, so it runs
here, in a process with its own address-space limit, that the parent (`template_sandbox.py`) kills
when it runs past its time. This file is run by path (`python -I template_worker.py LIMIT_BYTES MAX_CHARS`)
and imports only the standard library and jinja2, never torch or the package.

Protocol on stdin/stdout: each message is an 8-byte little-endian length and that many bytes of
JSON (ASCII, escaped). Request {"template": str, "context": {...}}; reply {"text": str} or
{"error": str, "kind": str}.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from datetime import datetime

MAX_COMPILED = 8  # compiled templates kept (one model has one or two)


def _exit_with_parent() -> None:
    """Exit when the parent goes, even in the middle of a loop: a watchdog thread polls the parent
    id (the GIL passes between threads every few milliseconds, so a looping render cannot starve
    it). Not PR_SET_PDEATHSIG: that follows the parent *thread* that started the worker, and a
    server renders from many threads that come and go."""
    import threading
    import time
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _limit_memory(limit_bytes: int) -> None:
    import resource
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        if hasattr(resource, name):
            try:
                resource.setrlimit(getattr(resource, name), (limit_bytes, limit_bytes))
                return
            except (ValueError, OSError):
                continue


def _environment():
    """As transformers renders chat templates: immutable sandbox, loop controls, its tojson."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_exact(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def _send(obj: dict) -> None:
    data = json.dumps(obj).encode("ascii")  # ASCII JSON carries any str, lone surrogates too
    sys.stdout.buffer.write(struct.pack("<Q", len(data)) + data)
    sys.stdout.buffer.flush()


def _render(env, compiled: dict, request: dict, max_chars: int) -> dict:
    from jinja2 import TemplateSyntaxError
    source = request["template"]
    template = compiled.get(source)
    if template is None:
        try:
            template = env.from_string(source)
        except TemplateSyntaxError as e:
            return {"error": f"does not parse (line {e.lineno}: {e.message})", "kind": "syntax"}
        if len(compiled) >= MAX_COMPILED:
            compiled.pop(next(iter(compiled)))
        compiled[source] = template
    text = template.render(**request["context"])
    if len(text) > max_chars:
        return {"error": f"wrote {len(text):,} characters (the limit is {max_chars:,})", "kind": "size"}
    return {"text": text}


def main() -> None:
    sys.path[:0] = json.loads(os.environ.get("SEQUOIA_OFFLOAD_WORKER_PATH", "[]"))  # the parent's
    _exit_with_parent()
    _limit_memory(int(sys.argv[1]))
    max_chars = int(sys.argv[2])
    env, compiled = _environment(), {}
    stdin = sys.stdin.buffer
    while True:
        head = _read_exact(stdin, 8)
        if head is None:  # the parent closed the pipe
            return
        body = _read_exact(stdin, struct.unpack("<Q", head)[0])
        if body is None:
            return
        try:
            reply = _render(env, compiled, json.loads(body), max_chars)
        except MemoryError:
            reply = {"error": "used more memory than its limit", "kind": "memory"}
        except RecursionError:
            reply = {"error": "recursed too deeply", "kind": "recursion"}
        except Exception as e:  # the template is the checkpoint's code: its failure is reported, not raised
            reply = {"error": f"{type(e).__name__}: {e}", "kind": "render"}
        try:
            _send(reply)
        except MemoryError:
            _send({"error": "used more memory than its limit", "kind": "memory"})


if __name__ == "__main__":
    main()
