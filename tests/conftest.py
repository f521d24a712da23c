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
