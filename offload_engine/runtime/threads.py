"""Handing torch's CPU compute from one thread to another without halving its speed.

torch's CPU build runs its parallel ops on GNU OpenMP (libgomp). libgomp keeps a thread team
(a pool of worker threads) for every thread that ever entered a parallel region, until that
thread exits. While two teams exist, libgomp counts more threads than the CPUs it may use and
stops every team's workers from spinning between parallel regions, so each parallel op of the
thread now computing waits for its workers to be woken. Measured on a 2-vCPU machine: the int8
matmuls of a draft level ran 2-2.5x slower on a worker thread than on the main thread that had
computed before it (and 2-4x slower while the layer loader thread kept a team of its own, which
is why the loader runs no parallel torch op where the compiled loop is built and the compute
dtype is float32: runtime/streamer.py).

`release_thread_team` frees the calling thread's team (OpenMP 5's `omp_pause_resource_all`),
so a thread that hands its compute to another (the server's generation worker) leaves only
one team behind. It does nothing where torch does not use libgomp.
"""

from __future__ import annotations

import ctypes
import os

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2


def _loaded_libgomps() -> list[str]:
    """Where to find the OpenMP runtime torch loaded: torch's own copy as /proc/self/maps lists
    it (some wheels rename it, e.g. libgomp-<hash>.so.1), then GNU's soname."""
    names = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libgomp") and ".so" in path and path not in names \
                        and "torch" in path:
                    names.append(path)
    except OSError:
        pass
    return names + ["libgomp.so.1"]  # (a torch copy found in the maps first: its team is the one to free)


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (a library already loaded is the one dlopen returns with
    RTLD_NOLOAD, which never loads another), or None where there is none with
    omp_pause_resource_all."""
    import torch  # noqa: F401 - loads torch's OpenMP runtime first

    for name in _loaded_libgomps():
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return lib
    return None


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP thread team (not inside a parallel region); True when
    libgomp freed it, False where there is nothing to free it with."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
