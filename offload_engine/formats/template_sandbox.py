"""Chat templates rendered out of process, within a time and a memory bound.

A GGUF file or a tokenizer_config.json carries its chat template as jinja2 source, and templates
from the internet are a known attack route. Jinja's `ImmutableSandboxedEnvironment` already
refuses attribute tricks, imports and mutation; what it cannot stop is a template that loops for
hours, recurses, or builds a string of many gigabytes. So templates render in a child process
(`template_worker.py`) under an address-space limit, and the parent kills the child when a render
runs past its time. One worker serves the whole process (a lock keeps requests in order); it is
started on first use, costs one round trip (well under a millisecond) per render, and is started
again after it is killed.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TIMEOUT_S = 5.0  # a chat template renders in about a millisecond; the first render also starts the worker
MEMORY_BYTES = 512 << 20  # the worker's address space: Python and jinja2 take about 30 MiB of it
MAX_CHARS = 16 << 20  # a rendered prompt longer than this is refused (a 128k-token context is ~0.5 M)
WORKER = Path(__file__).with_name("template_worker.py")


class TemplateFailure(Exception):
    """A render that failed: `kind` is syntax, render, recursion, memory, size (the template's
    doing), or timeout, crash, start (the worker's: the server answers these 503)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TemplateSandbox:
    """One worker process; `render` is safe to call from several threads."""

    def __init__(self, timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES, max_chars: int = MAX_CHARS):
        self.timeout_s, self.memory_bytes, self.max_chars = timeout_s, memory_bytes, max_chars
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stderr = None  # the worker's stderr (a file: read only when it dies)
        self._replied = False  # whether this worker has answered once (else a death is a failed start)

    def render(self, source: str, context: dict) -> str:
        request = json.dumps({"template": source, "context": context}, default=str).encode("ascii")
        with self._lock:
            proc = self._start()
            try:
                try:
                    proc.stdin.write(struct.pack("<Q", len(request)) + request)
                    proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    raise self._died() from None
                reply = json.loads(self._read_reply(proc))
            except BaseException:  # a timeout, a death, Ctrl-C: a reply may still be on its way
                self._stop()  # so this worker goes; the next render starts one in step
                raise
            self._replied = True
        if "error" in reply:
            raise TemplateFailure(reply.get("kind", "render"), reply["error"])
        return reply["text"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            # -I: no current folder or user site on its path; it gets the parent's path instead
            # (jinja2 may be on PYTHONPATH or in the user site)
            env = dict(os.environ, SEQUOIA_OFFLOAD_WORKER_PATH=json.dumps([p for p in sys.path if p]))
            self._stderr = tempfile.TemporaryFile()
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", str(WORKER), str(self.memory_bytes), str(self.max_chars)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, close_fds=True, env=env)
            except OSError as e:
                self._stderr.close()
                raise TemplateFailure("start", f"could not start its worker ({e.strerror or e})") from None
            self._replied = False
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout, self._stderr):
                try:
                    pipe.close()
                except OSError:
                    pass
            self._proc = None

    def _read_reply(self, proc: subprocess.Popen) -> bytes:
        """The reply's bytes (never more: the next reply is the next render's), or the worker
        killed when the deadline passes."""
        deadline, fd, data, need = time.monotonic() + self.timeout_s, proc.stdout.fileno(), bytearray(), 8
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while len(data) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TemplateFailure("timeout", f"ran longer than {self.timeout_s:g} s and was stopped")
                chunk = os.read(fd, min(need - len(data), 1 << 20))
                if not chunk:
                    raise self._died()
                data += chunk
                if need == 8 and len(data) == 8:
                    need = 8 + struct.unpack("<Q", bytes(data))[0]
        return bytes(data[8:])

    def _died(self) -> TemplateFailure:
        code = self._proc.wait() if self._proc is not None else None
        self._stderr.seek(0)
        said = self._stderr.read()[-2000:].decode("utf-8", "replace").strip().splitlines()
        how = f"exit status {code}"
        if code is not None and code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        if not self._replied and code is not None and code > 0:  # it never answered: it did not start
            return TemplateFailure("start", f"could not start its worker ({how}: {said[-1] if said else 'no message'})")
        return TemplateFailure("crash", f"stopped its worker ({how}), most likely past the "
                                        f"{self.memory_bytes >> 20} MiB memory limit")


_shared: TemplateSandbox | None = None
_shared_lock = threading.Lock()


def shared_sandbox() -> TemplateSandbox:
    """The process's worker, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = TemplateSandbox()
        return _shared


def _forget_in_child() -> None:
    """A forked child starts its own worker: the parent's pipes (and its lock, which another
    thread may have held at the fork) are not the child's to use."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
