"""Statistical tests draw their samples as WORKERS independent seeded streams in spawned processes
(the machine has two cores): the same i.i.d. samples in about half the time, deterministic for a
given WORKERS. conftest.py's session-scoped `pool` fixture is the executor."""

from concurrent.futures import ProcessPoolExecutor

WORKERS = 2


def shares(n: int) -> list[int]:
    """n samples split over the WORKERS streams."""
    return [n // WORKERS + (i < n % WORKERS) for i in range(WORKERS)]


def spawn_pool() -> ProcessPoolExecutor:
    import multiprocessing
    return ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"))
