"""What the online planner learned, kept from one run to the next (`--tree auto`, adapting).

A planner (`adaptive.OnlinePlanner`) starts from a stored acceptance vector, measured on a few
calibration prompts, and learns this user's acceptance from every tree step (the hazard of each
rank, `AcceptanceEstimate`) and how long this user's answers are (the lengths of the answers that
ended on their own). Within one process that carries from one generation to the next; without
this module a new `chat`, `generate` or `demo` started again from the calibration prompts'
vector and from no lengths, and its first line's prediction was the calibration prompts' (the
demo, 2026-12-05: 12.96 tokens a step predicted for a 128-token answer, 8.25-11.0 measured on its
67-token answer, the same answer every run).

So after each generation of an engine loaded with `remember=True` (the CLI's default but for
`demo`, which plans from the stored vectors alone; `--forget` turns it off) the planner's state is written to <cache>/learned/<key>.json: the decayed counts of
the acceptance estimate (its prior's pseudo-observations included, so that a restored estimate
goes on exactly as the old one would have), the stored prior it started from, and the lengths of
the last answers that ended on their own. The next load with the same target, draft and stored
vector plans from it: the load-time tree, the first line's prediction and the planner's start.
The key holds the target's fingerprint, the draft's key, the vector's temperature and the
stored vector itself, so a new stored vector (or another draft) starts afresh. A file that does
not parse or does not fit is ignored (and replaced by the next write); writes are atomic.

Only acceptance and lengths are kept, not timings: the machine's speed is read again at every
load (`profiler.speed_now`) and within a run by the planner's timing factors.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from sequoia_trees.acceptance import AcceptanceVector

from ..fsutil import atomic_write_text, cache_root

VERSION = 2  # 2: the pair's counts and the answer's on two levels (`adaptive.AcceptanceEstimate`)


def folder() -> Path:
    return cache_root() / "learned"


def path_for(target_fingerprint: str, draft_key: str, temperature: float, prior: AcceptanceVector) -> Path:
    """The file of one (target, draft, vector temperature, stored vector)."""
    ident = json.dumps([VERSION, target_fingerprint, draft_key, round(float(temperature), 3),
                        [round(float(p), 12) for p in prior.probs]])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:20]
    return folder() / f"{digest}.json"


MAX_COUNT = 1e6  # a count never comes near this (the pair's are at most PAIR_NODES = 32)
MAX_LENGTH = 10 ** 7  # tokens of an answer
MAX_STEPS = 10 ** 12


def load(path: Path, prior: AcceptanceVector) -> tuple[dict | None, str | None]:
    """(state, None) when `path` holds a usable state learned from `prior`; (None, why) when it
    is there but unusable (whatever it holds: it is a cache file anyone could have written);
    (None, None) when there is none."""
    try:
        if not path.exists():
            return None, None
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"it cannot be read ({exc.__class__.__name__})"
    try:
        why = _invalid(state, prior)
        if why is None:
            vector(state, prior)  # (it must make a vector: hazards within [0, 1])
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as exc:
        why = f"it does not make an acceptance vector ({exc.__class__.__name__})"
    return (None, why) if why else (state, None)


def _number(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and 0 <= x <= MAX_COUNT


def _count(x, most: int) -> bool:
    return type(x) is int and 0 <= x <= most


def _invalid(state, prior: AcceptanceVector) -> str | None:
    from .adaptive import LENGTH_WINDOW, AcceptanceEstimate
    if not isinstance(state, dict) or state.get("version") != VERSION:
        return "another version"
    w = prior.width
    lists = {k: state.get(k) for k in ("prior", "prior_hazards", "accepted", "at_risk")}
    for k, v in lists.items():
        if not isinstance(v, list) or len(v) != w or not all(_number(x) for x in v):
            return f"its {k!r} is not {w} numbers within 0 and {MAX_COUNT:g}"
    if any(abs(a - b) > 1e-9 for a, b in zip(lists["prior"], prior.probs)):
        return "it was learned from another stored vector"
    if any(abs(a - b) > 1e-9 for a, b in zip(lists["prior_hazards"], AcceptanceEstimate(prior).prior_h)):
        return "its prior hazards are not the stored vector's"
    if any(a > n for a, n in zip(lists["accepted"], lists["at_risk"])):
        return "it counts more acceptances than tries"
    ended = state.get("ended")
    if not isinstance(ended, list) or len(ended) > LENGTH_WINDOW or not all(
            _count(x, MAX_LENGTH) and x > 0 for x in ended):
        return f"its answer lengths are not at most {LENGTH_WINDOW} counts of tokens"
    for k in ("tree_steps", "generations"):
        if not _count(state.get(k), MAX_STEPS):
            return f"its {k!r} is not a count"
    return None


def save(path: Path, prior: AcceptanceVector, planner) -> None:
    """Write `planner`'s state (learned from `prior`) to `path`, whole or not at all."""
    state = {"version": VERSION, "prior": list(prior.probs), **planner.learned_state(),
             "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(state, indent=1) + "\n")


def vector(state: dict, prior: AcceptanceVector) -> AcceptanceVector:
    """The acceptance vector a restored estimate gives (what the load-time plan is made from)."""
    from .adaptive import AcceptanceEstimate
    est = AcceptanceEstimate(prior)
    est.restore(state["prior_hazards"], state["accepted"], state["at_risk"], state["tree_steps"])
    return est.vector()


def describe(state: dict) -> str:
    k = len(state["ended"])
    return (f"learned from {state['tree_steps']} tree steps of {state['generations']} earlier answers"
            + (f", the lengths of the last {k} that ended on their own" if k else ""))
