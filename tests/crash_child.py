"""One run of an operation in a forked child, for tests/crash_harness.py: the child's audit hook
reports (and may stop at) its filesystem events; the parent follows it, kills or freezes it at a
delay counted in the child's CPU time, and notices a server answering. Not collected by pytest."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
import traceback
import urllib.request
from pathlib import Path

WRITE_EVENTS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "shutil.copyfile", "os.chmod",
                "os.utime", "os.truncate", "os.link", "os.symlink"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CHILD_TIMEOUT_S = 120.0  # a run that takes longer hangs (the slowest uninterrupted run here takes seconds)


def fs_event(event: str, args: tuple) -> tuple[str, str] | None:
    """(path, target) a filesystem-changing audit event touches, else None."""
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writes and isinstance(path, (str, bytes, os.PathLike)):
            return os.fsdecode(path), ""
        return None
    if event in WRITE_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
        if event == "shutil.copyfile":  # what it writes is its destination
            return os.fsdecode(args[1]), os.fsdecode(args[0])
        second = args[1] if event in ("os.rename", "os.link") else ""
        return os.fsdecode(args[0]), os.fsdecode(second) if second else ""
    return None


def _child(art, ctx, first: bool, pipes: dict, event_k: int | None, pause_at: set, record_syncs: bool) -> None:
    code = 1
    try:
        log = os.open(pipes["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ["XDG_CACHE_HOME"] = str(ctx.live / "cache")
        import torch
        torch.set_num_threads(1)
        root, count, ev_fd = str(ctx.live), [0], pipes["events"]

        def hook(event, args):
            hit = fs_event(event, args)
            if hit is None or not (hit[0].startswith(root) or hit[1].startswith(root)):
                return
            count[0] += 1
            os.write(ev_fd, (json.dumps(["event", event, *hit]) + "\n").encode())
            if count[0] == event_k:
                os.kill(os.getpid(), signal.SIGKILL)
            if count[0] in pause_at:  # frozen here while the parent copies the folder
                os.write(pipes["pause_w"], b"P")
                os.read(pipes["cont_r"], 1)
        sys.addaudithook(hook)
        if record_syncs:
            _record_syncs(ev_fd, root)
        os.write(pipes["start_w"], b"S")
        result = art.op(ctx, first)
        sys.stdout.flush()
        Path(pipes["result"]).write_text(json.dumps(result))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child reports everything, then exits
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _record_syncs(ev_fd: int, root: str) -> None:
    """Log every fsync (by the path of its descriptor) and every rename with what it moves."""
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        os.write(ev_fd, (json.dumps(["fsync", os.readlink(f"/proc/self/fd/{fd}")]) + "\n").encode())
        return real_fsync(fd)

    def moving(real):
        def move(src, dst, *a, **kw):
            src_s, dst_s = os.fsdecode(src), os.fsdecode(dst)
            if src_s.startswith(root):
                files, dirs = [src_s], []
                if os.path.isdir(src_s):
                    files, dirs = [], [src_s]
                    for d, sub, names in os.walk(src_s):
                        files += [os.path.join(d, n) for n in names]
                        dirs += [os.path.join(d, n) for n in sub]
                os.write(ev_fd, (json.dumps(["rename", src_s, dst_s, files, dirs]) + "\n").encode())
            return real(src, dst, *a, **kw)
        return move
    os.fsync, os.rename, os.replace = fsync, moving(real_rename), moving(real_replace)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return json.loads(r.read()).get("status") == "ok"
    except (OSError, ValueError):
        return False


class Run:
    """What one child did: how it ended, its filesystem events, its result and its log."""

    def __init__(self):
        self.killed_by, self.status, self.hung, self.served = None, None, False, False
        self.started = self.duration = self.cpu_s = None
        self.events, self.result, self.log, self.query = [], None, "", None
        # a server's events before it answered (its query's, such as what the planner learned,
        # come after; a run killed at an event is never queried, so cannot reach those)
        self.events_at_served: int | None = None

    @property
    def finished(self) -> bool:
        return self.status == 0 or self.served


def run_child(art, ctx, first: bool, event_k: int | None = None, delay: float | None = None, query: bool = False,
              record_syncs: bool = False, pause_at: set = frozenset(), freeze_at: list = (), on_freeze=None) -> Run:
    """Fork a child that runs `art.op` in ctx.live. Kill it at its event `event_k` (it does, itself)
    or `delay` seconds after its operation starts; freeze it at each event of `pause_at` and each
    delay of `freeze_at` (its running time) and call `on_freeze(kind, value, events so far)` while
    it stands still. A server is killed once it answers (after `art.query` when `query`)."""
    ctx.runs += 1
    stem = ctx.work / "logs" / f"{art.name}-{ctx.runs}"
    pipes = {x: str(stem) + "." + x for x in ("log", "result")}
    ev_path = Path(str(stem) + ".events")
    start_r, pipes["start_w"] = os.pipe()
    pause_r, pipes["pause_w"] = os.pipe()
    pipes["cont_r"], cont_w = os.pipe()
    pipes["events"] = os.open(ev_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    ctx.port = free_port() if art.server else None
    pid = os.fork()
    if pid == 0:
        _child(art, ctx, first, pipes, event_k, set(pause_at), record_syncs)
    for fd in (pipes["start_w"], pipes["pause_w"], pipes["cont_r"], pipes["events"]):
        os.close(fd)
    run = Run()
    events = lambda: [json.loads(line) for line in ev_path.read_text().splitlines()]  # noqa: E731

    def freeze(kind, value):
        seen = events()
        on_freeze(kind, value if kind == "delay" else sum(e[0] == "event" for e in seen), seen)
    try:
        _watch(art, ctx, pid, (start_r, pause_r, cont_w), run, delay, query, sorted(freeze_at), freeze,
               lambda: len(events()))
    finally:
        for fd in (start_r, pause_r, cont_w):
            os.close(fd)
    run.events = events()
    run.log = Path(pipes["log"]).read_text(errors="replace")
    if run.status == 0 and Path(pipes["result"]).exists():
        run.result = json.loads(Path(pipes["result"]).read_text())
    for p in (ev_path, Path(pipes["log"]), Path(pipes["result"])):
        p.unlink(missing_ok=True)
    return run


def cpu_s(pid: int) -> float | None:
    """CPU time a process's threads have run (the scheduler's count, in ns): delays are counted in
    it, so that a busy machine moves no kill point to another phase."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that just ended
    except (FileNotFoundError, ProcessLookupError):
        return None
    return total / 1e9


def _watch(art, ctx, pid: int, fds: tuple, run: Run, delay: float | None, query: bool, freeze_at: list,
           freeze, count_events=None) -> None:
    """Follow the child: freeze or kill it when its CPU time since its operation started reaches a
    delay, serve its pauses at events, notice a server answering, and reap it."""
    start_r, pause_r, cont_w = fds
    pidfd = os.pidfd_open(pid)
    try:
        if select.select([start_r, pidfd], [], [], CHILD_TIMEOUT_S)[0] and os.read(start_r, 1) == b"S":
            run.started = time.monotonic()
        t0, cpu0, reaped = run.started or time.monotonic(), cpu_s(pid) or 0.0, None
        cpu = 0.0
        while True:
            now = time.monotonic()
            # (0.5 ms at a delay: a store built in 10 ms of CPU would otherwise see five polls, and
            # delays drawn within its run often came due only after it had ended)
            wait = 0.0005 if delay is not None or freeze_at else 0.002 if art.server else 0.02
            ready = select.select([pidfd, pause_r], [], [], wait)[0]
            if pause_r in ready and os.read(pause_r, 1) == b"P":  # paused at an event
                freeze("event", None)
                os.write(cont_w, b"C")
                continue
            if pidfd in ready:
                break  # the child ended
            cpu = (cpu_s(pid) or cpu0 + cpu) - cpu0
            if freeze_at and cpu >= freeze_at[0]:
                reaped = _stopped(pid, lambda: freeze("delay", freeze_at.pop(0)))
                if reaped is not None:
                    break  # it ended just before
                continue
            if delay is not None and cpu >= delay:
                run.killed_by = "parent"
                os.kill(pid, signal.SIGKILL)
                break
            if art.server and _healthy(ctx.port):
                run.served, run.cpu_s = True, cpu
                if count_events is not None:
                    run.events_at_served = count_events()
                if query:
                    run.query = art.query(ctx)
                os.kill(pid, signal.SIGKILL)
                break
            if now - t0 >= CHILD_TIMEOUT_S:
                run.hung = True
                os.kill(pid, signal.SIGKILL)
                break
        run.duration = time.monotonic() - t0
        if run.cpu_s is None:
            run.cpu_s = cpu  # the last count read (at most a poll short of the end)
        _ended(run, reaped if reaped is not None else os.waitpid(pid, 0)[1])
    finally:
        os.close(pidfd)


def _stopped(pid: int, action) -> int | None:
    """Run `action` while the child is SIGSTOPped; its wait status instead if it had ended."""
    os.kill(pid, signal.SIGSTOP)
    status = os.waitpid(pid, os.WUNTRACED)[1]
    if not os.WIFSTOPPED(status):
        return status
    action()
    os.kill(pid, signal.SIGCONT)
    return None


def _ended(run: Run, status: int) -> None:
    if os.WIFSIGNALED(status):
        run.status = -os.WTERMSIG(status)
        if run.killed_by is None and not run.served and not run.hung:
            run.killed_by = "self"
    else:
        run.status = os.WEXITSTATUS(status)
