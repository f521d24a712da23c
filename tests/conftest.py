import gc
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    """Processes for the statistical tests' sample streams (tests/streams.py), started once for the
    session: each spawned process imports torch and the test module it runs (3 s for the two), and
    takes 1 s to stop. What jobs change in their process (the decoder's verifier, the adaptive
    planner's constants, the decoder's limits on trees grown ahead) is test_speculative_distribution.py's,
    as it was with one pool for that module; test_verify_distribution.py's jobs run sequoia_trees
    alone, which no job changes."""
    from streams import spawn_pool
    with spawn_pool() as ex:
        yield ex


@pytest.fixture
def report():
    """report(part, figures): hostile_report.write_report, for the tests that take it as a fixture."""
    from hostile_report import write_report
    return write_report


_frozen_at = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each module's first test (and its module fixtures), what is alive is collected and
    frozen (gc.freeze): the runner, every imported library and what earlier modules left. A full
    collection, whether one a test's code asks for or one Python's allocation counts start, then
    walks what this module made, not those 500,000 objects again (0.2-0.3 s a collection; such
    collections took about 16 s of the suite, most of them while test_default_model.py,
    test_layering.py and test_default_tokenizer.py parse files into many objects). What is frozen
    is still freed by its reference count; only a reference cycle among frozen objects would stay."""
    module = item.nodeid.split("::")[0]
    if module != _frozen_at[0]:
        if _frozen_at[0] is None and importlib.util.find_spec("hypothesis"):
            # (imported before the first freeze: on import, its plugins register their random
            # generators and warn when gc.get_referrers finds nothing referring to one, which it
            # cannot see once frozen; the whole suite imports it while collecting anyway)
            import hypothesis  # noqa: F401
        _frozen_at[0] = module
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # (the interpreter's exit then finalizes them as it would have)
