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
    """report(part, figures): merge figures into $HOSTILE_REPORT_DIR/<part>.json when that variable
    is set (the hostile suite's page, docs/hostile.md, is made from these files); else nothing."""
    import json
    import os

    def write(part: str, figures: dict) -> None:
        folder = os.environ.get("HOSTILE_REPORT_DIR")
        if not folder:
            return
        path = Path(folder) / f"{part}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(figures)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
    return write
