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

import torch

from sequoia_trees.acceptance import AcceptanceVector, greedy_rates, teacher_forced_rates
from sequoia_trees.sampling import SamplingParams, logits_to_probs

from ..errors import UserError
from ..fsutil import DATA_DIR, atomic_write_text
from .acceptance_store import acceptance_cache_dir, known_vectors, stored_vectors
from .decoder import TreeSpec

DEFAULT_PROMPTS = DATA_DIR / "distill_prompts.jsonl"  # distill's prompt list, and auto's quick measurement's
# --tree auto's quick on-policy measurement when no vector is stored for the pair
AUTO_PROMPTS = 4
AUTO_NEW_TOKENS = 24
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
                  params: SamplingParams, prompts: int, draft) -> dict:
    """The JSON a measured vector is stored as (the acceptance command's output, the store's input)."""
    return {"acceptance": list(vector.probs), "mode": mode, "width": width, "temperature": params.temperature,
            "top_p": params.top_p, "samples": samples, "prompts": prompts, "target": str(engine.folder),
            "draft": str(draft), "target_fingerprint": engine.target_fingerprint, "draft_key": engine.draft_key}


def on_policy(engine, prompts: list[dict], width: int, params: SamplingParams, max_new_tokens: int,
              seed: int) -> tuple[AcceptanceVector, int]:
    """Decode every prompt with a one-level tree of `width` children; count the accepted rank."""
    if engine.draft is None:
        raise UserError("measuring acceptance needs a draft (--draft)")
    saved, stored, auto = engine.tree, engine.stored_acceptance, engine.auto_plans
    engine.tree = TreeSpec("sequoia", width + 1, 2, acceptance=AcceptanceVector((0.5 / width,) * width))
    engine.stored_acceptance, engine.auto_plans = {}, {}  # the one-level tree of `width` children, whatever else
    counts, steps = torch.zeros(width, dtype=torch.float64), 0
    try:
        for i, item in enumerate(prompts):
            stats = engine.generate(**item, max_new_tokens=max_new_tokens, temperature=params.temperature,
                                    top_p=params.top_p, seed=seed + i).stats
            counts += torch.tensor(stats["acceptance_by_rank"][:width], dtype=torch.float64)
            steps += stats["target_steps"]
    finally:
        engine.tree, engine.stored_acceptance, engine.auto_plans = saved, stored, auto
    if not steps:
        raise UserError("no speculation step ran (answers of one token?); use longer prompts or --max-new-tokens")
    return AcceptanceVector(tuple((counts / steps).tolist())), steps


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
              f"({AUTO_PROMPTS} prompts x {AUTO_NEW_TOKENS} tokens, width {AUTO_WIDTH}, T="
              f"{' and '.join(f'{t:g}' for t in temperatures)}), once; cached", file=sys.stderr)
    prompts = read_prompts(DEFAULT_PROMPTS)[:AUTO_PROMPTS]
    root = acceptance_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for t in temperatures:
        vector, steps = on_policy(engine, prompts, AUTO_WIDTH, SamplingParams(t, 1.0), AUTO_NEW_TOKENS, 0)
        data = vector_record(engine, vector, steps, "on-policy", AUTO_WIDTH, SamplingParams(t, 1.0),
                             len(prompts), engine.draft_key)
        name = f"{engine.target_fingerprint}__{_safe(engine.draft_key)}__t{t:g}.json"
        atomic_write_text(root / name, json.dumps(data, indent=2) + "\n")
        out[t] = (vector, root / name)
    return out


def _safe(key: str | None) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(key))
