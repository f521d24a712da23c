"""Torch's compute handed between threads keeps one OpenMP team (runtime/threads.py)."""

import os
import threading
import time

import torch

from offload_engine.apps import server
from offload_engine.runtime.threads import release_thread_team


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_release_thread_team_frees_the_calling_threads_workers():
    """On a thread that ran a parallel op (its team: one worker per extra torch thread), the
    release frees the workers; the next parallel op makes the team again and computes the same."""
    assert "OpenMP" in torch.__config__.parallel_info()  # the CPU build this project installs
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    result = {}

    def work():
        x = torch.arange(1 << 22, dtype=torch.float32)
        want = x.mul(3).sum()
        with_team = _os_threads()
        result["released"] = release_thread_team()
        deadline = time.monotonic() + 2  # (a joined worker leaves /proc a moment later)
        while _os_threads() & with_team == with_team and time.monotonic() < deadline:
            time.sleep(0.01)
        result["gone"] = with_team - _os_threads()
        result["again"] = bool(x.mul(3).sum() == want)

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert result["released"] and result["again"]
    assert result["gone"], result  # the team's worker thread ended


def test_the_scheduler_frees_its_threads_team_before_its_worker_computes(monkeypatch):
    """`serve` loads the engine on the main thread and generates on the scheduler's worker: the
    main thread's team is freed first (else every matmul of the worker runs at about half speed
    on a 2-vCPU machine)."""
    calls = []
    started = threading.active_count()
    monkeypatch.setattr(server, "release_thread_team",
                        lambda: calls.append((threading.current_thread(), threading.active_count())))
    scheduler = server.Scheduler(None, max_queue=1)
    try:
        assert calls == [(threading.current_thread(), started)]  # on this thread, before the worker started
    finally:
        scheduler.close()
