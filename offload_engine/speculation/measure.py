"""Measuring a (target, draft) pair's acceptance vector (REFERENCES.md 1.2).

on-policy: real decoding with a one-level tree of `width` children; p_i = how often the i-th
child was the accepted one. teacher-forced: over the prompts' own text, the analytic rates at
every position (cheaper: one target pass per text, no generation).

`engine` below is an `offload_engine.Engine`, taken as it is passed in and never imported: the
engine sits above this layer and calls `vectors_for` itself when `--tree auto` finds no stored
vector for its pair.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from sequoia_trees.acceptance import AcceptanceVector, RankEvidence, greedy_rates, teacher_forced_rates
from sequoia_trees.sampling import SamplingParams, logits_to_probs

from ..errors import UserError
from ..fsutil import DATA_DIR, atomic_write_text
from .acceptance_store import MEASUREMENT, acceptance_cache_dir, known_vectors, stored_vectors
from .decoder import TreeSpec

DEFAULT_PROMPTS = DATA_DIR / "distill_prompts.jsonl"  # distill's prompt list, and auto's quick measurement's
# --tree auto's quick on-policy measurement when no vector is stored for the pair
AUTO_PROMPTS = 8  # at most: the measurement stops once the first rank was tried AUTO_TRIALS times
# (or rejected AUTO_REJECTIONS times)
AUTO_NEW_TOKENS = 24
# the first rank's trials the quick measurement aims at: a draft the target follows 98% of the
# time is rejected about 4 times in them (48 one-level steps, before 2026-12-05, saw 3 rejections
# and stored 0.9375: what a deep tree is worth hangs on 1 - p_1)
AUTO_TRIALS = 192
# ... or rejected this many times: 1 - p_1 then known within about 15% (a weak draft, p_1 = 0.46,
# gets there in about 4 prompts, where 192 trials took all 8 and 27-30 s against 12-14)
AUTO_REJECTIONS = 48
AUTO_WIDTH = 16
AUTO_TEMPERATURES = (0.0, 0.6)


def read_prompts(path: str | Path) -> list[dict]:
    """One prompt per line, or JSONL lines holding a list of chat messages or {"messages": [...]}.
    Returns [{"messages": [...]}] or [{"prompt": "..."}] items."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read prompts ({e})") from None
    items = []
    # lines end at "\n" only: U+2028, U+0085 and the like are text, and may sit inside a JSON string
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if line.lstrip().startswith(("{", "[")):
            items.append({"messages": _messages(path, number, line)})
        else:
            items.append({"prompt": line})
    if not items:
        raise UserError(f"{path}: no prompts")
    return items


def _messages(path: Path, number: int, line: str) -> list[dict]:
    """The chat messages of one JSONL line, each with a text role and content."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{number}: not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # an integer of more than 4300 digits; nesting too deep
        raise UserError(f"{path}:{number}: not valid JSON ({e})") from None
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise UserError(f'{path}:{number}: expected a list of messages {{"role": text, "content": text}} or '
                        '{"messages": [...]}')
    return messages


def vector_record(engine, vector: AcceptanceVector, samples: int, mode: str, width: int,
                  params: SamplingParams, prompts: int, draft, evidence: RankEvidence | None = None,
                  depth: int | list[int] | None = None) -> dict:
    """The JSON a measured vector is stored as (the acceptance command's output, the store's
    input); on-policy, the measuring tree's depth (per prompt, where it changed) and the counts per
    rank (`RankEvidence`)."""
    record = {"acceptance": list(vector.probs), "mode": mode, "width": width, "temperature": params.temperature,
              "top_p": params.top_p, "samples": samples, "prompts": prompts, "target": str(engine.folder),
              "draft": str(draft), "target_fingerprint": engine.target_fingerprint, "draft_key": engine.draft_key}
    if depth is not None:
        record["depth"] = depth
    if evidence is not None:
        record["rank_evidence"] = evidence.as_dict()
    return record


MEASURE_DEPTH = 8  # levels of the on-policy measuring tree, its root's included (2: one level)
MEASURE_SPINE = 4  # children of each first child below the root's level
DEEP_HAZARD = 0.8  # the first rank's hazard from which the quick measurement keeps MEASURE_DEPTH levels
SHALLOW_DEPTH = 3  # its levels below that


def measuring_tree(width: int, depth: int = MEASURE_DEPTH, spine: int = MEASURE_SPINE) -> tuple[int, ...]:
    """Parents (BFS order) of the tree on-policy measurement decodes with: `width` children below
    the root, then below each level's first child (rank 0) `spine` children more, `depth` levels
    in all (depth 2: the one-level tree). A step whose first children are accepted k times in a
    row measures rank 0 k + 1 times, where a one-level tree measures it once: with a draft that
    the target follows 98% of the time, 48 one-level steps saw 3 rejections and stored 0.9375
    (2026-12-05), where the steps of a deep tree then accepted 0.97-0.98 at every depth."""
    if width < 1 or depth < 2 or spine < 1:
        raise ValueError(f"a measuring tree needs width >= 1, depth >= 2 and spine >= 1, got {width}, {depth}, {spine}")
    parents, first = [-1] + [0] * width, 1
    for _ in range(depth - 2):
        start = len(parents)
        parents += [first] * spine
        first = start
    return tuple(parents)


def on_policy(engine, prompts: list[dict], width: int, params: SamplingParams, max_new_tokens: int,
              seed: int, depth: int | None = MEASURE_DEPTH,
              trials: int | None = None, rejections: int | None = None) -> "OnPolicy":
    """Decode the prompts with the measuring tree (`measuring_tree`: `width` children below the
    root, `depth` levels; None: `measuring_depth` of the evidence so far, before each prompt); the
    vector from the hazards of every accepted path's nodes (`RankEvidence`). With `trials` (or
    `rejections`), stop after the prompt at which the first rank has been tried (or rejected)
    that many times."""
    if engine.draft is None:
        raise UserError("measuring acceptance needs a draft (--draft)")
    saved, stored, auto = engine.tree, engine.stored_acceptance, engine.auto_plans
    engine.stored_acceptance, engine.auto_plans = {}, {}  # the measuring tree, whatever else
    evidence, steps, depths = RankEvidence(width), 0, []
    try:
        for i, item in enumerate(prompts):
            levels = measuring_depth(evidence) if depth is None else depth
            parents = measuring_tree(width, levels)
            depths.append(levels)
            engine.tree = TreeSpec("sequoia", len(parents), levels, parents=parents,
                                   acceptance=AcceptanceVector((0.5 / width,) * width))
            stats = engine.generate(**item, max_new_tokens=max_new_tokens, temperature=params.temperature,
                                    top_p=params.top_p, seed=seed + i).stats
            evidence.add_counts(stats["rank_evidence"]["at_risk"], stats["rank_evidence"]["accepted"])
            steps += stats["target_steps"]
            tried, rejected = evidence.at_risk[0], evidence.at_risk[0] - evidence.accepted[0]
            if (trials is not None and tried >= trials) or (rejections is not None and rejected >= rejections):
                break
    finally:
        engine.tree, engine.stored_acceptance, engine.auto_plans = saved, stored, auto
    if not steps:
        raise UserError("no speculation step ran (answers of one token?); use longer prompts or --max-new-tokens")
    return OnPolicy(evidence.vector(), steps, evidence, tuple(depths))


class OnPolicy(NamedTuple):
    vector: AcceptanceVector
    steps: int
    evidence: RankEvidence
    depths: tuple[int, ...]  # the measuring tree's levels, per prompt decoded


def measuring_depth(evidence: RankEvidence) -> int:
    """The measuring tree's levels for the next prompt: MEASURE_DEPTH once the first rank's
    hazard is DEEP_HAZARD or more, else (and before anything is measured) SHALLOW_DEPTH: below a
    draft that the target leaves at the first or second token, deeper levels cost draft passes
    and measure almost nothing (the default draft, p_1 = 0.42: 8 levels on the first prompt, then
    3, took 24 s where the one-level tree took 14)."""
    if evidence.at_risk[0] and evidence.accepted[0] >= DEEP_HAZARD * evidence.at_risk[0]:
        return MEASURE_DEPTH
    return SHALLOW_DEPTH


def teacher_forced(engine, prompts: list[dict], width: int, params: SamplingParams,
                   seed: int) -> tuple[AcceptanceVector, int]:
    """Analytic rates at every position of each prompt's own tokens, averaged."""
    if engine.draft is None:
        raise UserError("measuring acceptance needs a draft (--draft)")
    g = torch.Generator().manual_seed(seed)
    total, positions = torch.zeros(width, dtype=torch.float64), 0
    for item in prompts:
        ids = engine.prompt_ids(**item)
        logits = []
        for model in (engine.model, engine.draft):
            dev = model.device
            out = model.forward(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev),
                                model.new_cache(len(ids)))
            logits.append(out.cpu())
        for t in range(len(ids)):
            if params.greedy:
                total += greedy_rates(logits[0][t], logits[1][t], width)
            else:
                total += teacher_forced_rates(logits_to_probs(logits[0][t], params),
                                              logits_to_probs(logits[1][t], params), width, g)
        positions += len(ids)
    return AcceptanceVector(tuple((total / positions).tolist())), positions


def vectors_for(engine, progress: bool) -> dict:
    """The pair's vectors by temperature: stored in the repo, cached, or measured now. The cache
    gets one file per temperature, one after the other: a set that a killed measurement left
    short is completed, never taken as it is."""
    found = known_vectors(engine.target_fingerprint, engine.draft_key)
    if stored_vectors(engine.target_fingerprint, engine.draft_key):  # the repo's, whatever they cover
        return found
    missing = tuple(t for t in AUTO_TEMPERATURES if t not in found)
    return {**found, **measure_and_cache(engine, progress, missing)} if missing else found


def measure_and_cache(engine, progress: bool, temperatures: tuple[float, ...] = AUTO_TEMPERATURES) -> dict:
    """auto's quick on-policy measurement at each of `temperatures`, cached in the acceptance
    command's format."""
    if progress:
        print(f"sequoia-offload: no acceptance vector is stored for this pair: measuring one on-policy "
              f"(up to {AUTO_PROMPTS} prompts x {AUTO_NEW_TOKENS} tokens, until the first rank is tried "
              f"{AUTO_TRIALS} or rejected {AUTO_REJECTIONS} times; trees of {AUTO_WIDTH} children and up to "
              f"{MEASURE_DEPTH} levels; T="
              f"{' and '.join(f'{t:g}' for t in temperatures)}), once; cached", file=sys.stderr)
    prompts = read_prompts(DEFAULT_PROMPTS)[:AUTO_PROMPTS]
    root = acceptance_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for t in temperatures:
        got = on_policy(engine, prompts, AUTO_WIDTH, SamplingParams(t, 1.0), AUTO_NEW_TOKENS, 0, depth=None,
                        trials=AUTO_TRIALS, rejections=AUTO_REJECTIONS)
        data = vector_record(engine, got.vector, got.steps, "on-policy", AUTO_WIDTH, SamplingParams(t, 1.0),
                             len(got.depths), engine.draft_key, got.evidence, list(got.depths))
        data["measurement"] = MEASUREMENT
        name = f"{engine.target_fingerprint}__{_safe(engine.draft_key)}__t{t:g}.json"
        atomic_write_text(root / name, json.dumps(data, indent=2) + "\n")
        out[t] = (got.vector, root / name)
    return out


def _safe(key: str | None) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(key))
