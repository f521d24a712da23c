"""Fuzzed parsers (issue 22, item 1): every file a user can point the runtime at either loads or is
refused with one `sequoia-offload: error:` line, within bounded time and memory, changing no input
and leaving no temporary file.

Each parser is fuzzed by tests/hostile_fuzz.py in a child process of its own, forked from one that
imported everything once (its peak RSS is the imports' and that parser's alone; an address-space limit turns a blow-up into a failure instead of swapping), with
derandomized hypothesis (the same inputs on every run) and a fixed number of examples. Then the
real CLI is run on a few of the refused inputs. With HOSTILE_REPORT_DIR set, the figures go to
$HOSTILE_REPORT_DIR/parsers.json:

    HOSTILE_REPORT_DIR=test-artifacts .venv/bin/python -m pytest -q tests/test_hostile_parsers.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hostile_report import write_report

pytestmark = pytest.mark.slow  # the children and CLI runs together: about a minute on two cores

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "hostile_fuzz.py"
# random examples per parser, chosen so that the whole file stays under 70 s on the 2-core
# development machine; besides them each parser runs a fixed sweep (hostile_inputs.*_sweep: every
# field given each hostile value; for GGUF every section-boundary cut and every length, count and
# type field at its extremes)
EXAMPLES = {"config": 80, "safetensors": 80, "gguf": 60, "tokenizer": 60, "prompts": 100, "profile": 60,
            "acceptance": 60, "ollama": 40}
CLI_PER_PARSER = 1  # refused inputs per parser given to the real CLI (each run imports torch: ~3 s of CPU)
# Peak RSS of a child: the imports (torch, tokenizers, gguf) take about 420 MiB here, and every input
# is a few KiB; a parser that believed a size the file claims (terabytes, 2^64 items) would need
# far more, and the child's address-space cap (hostile_fuzz.GUARD_BYTES) stops it first.
PEAK_RSS_MIB = 1024
# Per example: the inputs are a few KiB and the slowest parser (a GGUF file converted twice,
# sidecar and safetensors) takes about 0.3 s here; 5 s allows a loaded shared machine, far below a hang.
MAX_EXAMPLE_S = 5.0
# A fuzz whose inputs all load is not damaging them: at least a fifth must be refused (the prompts
# fuzz spends half its examples on valid files that must read back whole, so it refuses ~25%).
MIN_REFUSED_SHARE = 0.2


def _children(out: Path) -> dict:
    """Every parser's report: one runner that imports once and forks a child per parser, two at a time."""
    proc = subprocess.run([sys.executable, str(RUNNER), *(f"{n}={k}" for n, k in EXAMPLES.items()), "--report",
                           str(out / "reports"), "--save", str(out / "saved"), "--keep", str(CLI_PER_PARSER),
                           "--parallel", "2"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, f"a fuzz child failed:\n{proc.stderr[-3000:]}"
    return {n: json.loads((out / "reports" / f"{n}.json").read_text()) for n in EXAMPLES}


def _cli(case: dict, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp / "home"), XDG_CACHE_HOME=str(tmp / "cache"), HF_HUB_OFFLINE="1",
               SEQUOIA_OFFLOAD_NATIVE="0", **case["env"])
    return subprocess.run([sys.executable, "-m", "offload_engine", *case["argv"]], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """Every parser's report, the children run two at a time (the machine has two cores)."""
    out = tmp_path_factory.mktemp("hostile")
    (out / "saved").mkdir()
    done = _children(out)
    with ThreadPoolExecutor(2) as pool:
        cases = [(name, case) for name, r in done.items() for case in r["saved"]]
        runs = list(pool.map(lambda nc: _cli(nc[1], out / f"cli-{nc[0]}"), cases))
    for (name, case), proc in zip(cases, runs):
        done[name].setdefault("cli", []).append({"argv": case["argv"], "message": case["message"],
                                                 "returncode": proc.returncode, "stderr": proc.stderr})
    keys = ("examples", "random", "sweep", "loaded", "refused", "peak_rss_mib", "baseline_rss_mib",
            "max_example_s", "wall_s")
    write_report("parsers", {n: {k: r[k] for k in keys} | {"unexpected": len(r["unexpected"]),
                                                          "cli": [(c["returncode"], c["stderr"])
                                                                  for c in r.get("cli", [])]}
                             for n, r in done.items()})
    return done


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_input_loads_or_is_refused_in_one_line(reports, name):
    r = reports[name]
    assert r["base_loaded"], f"{name}: the undamaged base input does not load, so the fuzz tests nothing"
    assert r["examples"] >= EXAMPLES[name] * 0.9 + r["sweep"], r  # hypothesis ran (nearly) all it was asked
    problems = "\n\n".join(f"{u['example']}: {u['error']}\ninput: {json.dumps(u['input'])[:600]}"
                           for u in r["unexpected"][:5])
    assert not r["unexpected"], f"{name}: {len(r['unexpected'])} inputs gave something else:\n{problems}"
    assert r["refused"] >= MIN_REFUSED_SHARE * r["examples"], r
    assert r["peak_rss_mib"] <= PEAK_RSS_MIB, r
    assert r["max_example_s"] <= MAX_EXAMPLE_S, r


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_cli_prints_one_error_line_and_exits_2(reports, name):
    runs = reports[name].get("cli", [])
    assert len(runs) == CLI_PER_PARSER, f"{name}: only {len(runs)} distinct refusals to give the CLI"
    for run in runs:
        lines = run["stderr"].splitlines()
        assert run["returncode"] == 2, run
        assert "Traceback" not in run["stderr"], run
        assert len(lines) == 1 and lines[0].startswith("sequoia-offload: error: "), run
