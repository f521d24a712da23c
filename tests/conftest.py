import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    """Processes for the statistical tests' sample streams (tests/streams.py)."""
    from streams import spawn_pool
    with spawn_pool() as ex:
        yield ex


@pytest.fixture
def report():
    """report(part, figures): hostile_report.write_report, for the tests that take it as a fixture."""
    from hostile_report import write_report
    return write_report


@pytest.fixture(scope="session", autouse=True)
def closed_loaders_seen_sooner():
    """A closed engine's layer loader, blocked until a buffer is free, sees the close at its next
    poll (streamer._POLL_S, 0.2 s; the pass's own waits poll at the same rate): 0.07-0.13 s of
    every close of a streamed engine, about 540 closes and 30 s of the suite, most of it in
    test_draft_choice.py (each candidate evaluated on an engine of its own). The tests poll every
    10 ms; a release still wakes a waiting thread at once, and no test asserts how soon a closed
    or failed loader is noticed."""
    from offload_engine.runtime import streamer
    mp = pytest.MonkeyPatch()
    mp.setattr(streamer, "_POLL_S", 0.01)
    yield
    mp.undo()
