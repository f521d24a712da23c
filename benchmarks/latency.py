"""Latency of every decoding mode and a peer, side by side in one run (`sequoia-offload bench latency`).

    python benchmarks/latency.py [--target default] [--draft default] [--offload disk]
        [--prompts benchmarks/prompts.jsonl] [--limit 4] [--max-new-tokens 32] [--temperatures 0,0.6]
        [--budgets 16,64] [--quick] [--modes A,B] [--no-peer] [--out results.json] [--plots DIR]

Modes, each over the same prompts at each temperature (seeded per prompt):
  plain-resident   plain decoding, every target layer resident (no streaming)
  plain-streamed   plain decoding, the target streamed (`--offload`): the baseline
  chain-B          one drafted sequence of min(B, 16) tokens (chains longer than 16 are not run:
                   every token costs a draft pass)
  specinfer-B      (B-1)//(d-1) independent sequences of d-1 tokens (d = the depth for B)
  specexec-B       best-first tree of B nodes, d levels
  sequoia-B        Sequoia's optimal tree of B nodes, d levels, shaped by the pair's vector
  sequoia-auto     `--tree auto`: the tree the optimizer chooses for this machine, re-chosen every
                   few steps from what the steps measure (online adaptation)
  auto-no-adapt    `--tree auto --no-adapt`: the profile's choice kept for the whole run
  suffix           `--draft suffix`: no draft model, trees of continuations of text already seen
                   (the prompt, the output so far, and earlier prompts' text: `--suffix-study`), each
                   proposal run, trimmed or skipped by the measured cost of a wider pass (`SuffixGate`)
  suffix-rule      (`--suffix-study`) `--draft suffix --no-adapt`: SuffixDecoding's rule as published,
                   every proposal run whole
  model-auto, model-N,D, hybrid-auto, hybrid-N,D
                   (`--suffix-study`) the model draft alone and with suffix drafts grafted on
                   (`--draft MODEL+suffix`), with `--tree auto` and with a fixed Sequoia tree
  default, self-int8, self-int4, self-q8, self-q4, self-q8-no-overlap, self-q4-no-overlap,
  self-q8-overlap-auto, self-q4-overlap-auto
                   (`--draft-study`) each draft at one fixed Sequoia tree (`--study-tree`): the
                   distilled default draft, the full self-drafts, and the substitute self-drafts
                   (the target's resident layers, quantised copies of the streamed ones, the
                   target's KV cache shared) with the next tree grown during every pass
                   (`--overlap on`), never (`off`), and as `--overlap auto`'s gate says;
                   each row also splits its steps' time: draft before the pass, draft overlapped
                   (inside the pass), the pass, the rest
  best-fixed       (a row computed, not run) the fastest of plain-streamed and the fixed Sequoia
                   trees (`--hindsight`, or the sequoia-B modes) on the same prompts: the best fixed
                   choice in hindsight, which auto is measured against
  peer             the same model through transformers with HF Accelerate's disk_offload (its
                   offload files evicted from the page cache before every forward, as our disk
                   tier reads with O_DIRECT), greedy only; `--offload ram`: cpu_offload
Columns: tokens/step, seconds/token (decode only: prefill excluded), speed-up over plain-streamed
at the same temperature, target passes, bytes streamed per generated token, and at T=0 whether
the tokens equal plain-streamed's (computed per prompt, never assumed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
DEPTH_FOR_BUDGET = {16: 6, 32: 8, 64: 10, 128: 12, 256: 14}
CHAIN_MAX = 16
FIELDS = ("mode", "kind", "budget", "depth", "temperature", "tokens_per_step", "seconds_per_token",
          "speedup_vs_plain_streamed", "target_passes", "bytes_streamed_per_token", "equal_to_plain")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default")
    p.add_argument("--draft", default="default")
    p.add_argument("--offload", default="disk", choices=("disk", "ram"),
                   help="how the baseline and the speculative modes stream the target (default disk)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts.jsonl"))
    p.add_argument("--limit", type=int, default=4, help="use the first N prompts (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperatures", default="0,0.6")
    p.add_argument("--budgets", default="16,64", help="tree budgets for the fixed-size modes (default 16,64)")
    p.add_argument("--quick", action="store_true", help="3 prompts, 32 new tokens, budget 16 only")
    p.add_argument("--auto-study", action="store_true",
                   help="only plain-streamed, sequoia-auto, auto-no-adapt and the --hindsight trees (and the "
                        "best-fixed row): what adaptation is measured with")
    p.add_argument("--suffix-study", action="store_true",
                   help="only plain-streamed, the model draft, suffix and hybrid drafts (auto and --suffix-tree): "
                        "what suffix drafts are measured with (each engine's store starts empty at each temperature)")
    p.add_argument("--suffix-tree", default="16,4", help="the fixed Sequoia tree N,D of --suffix-study's model-N,D "
                                                         "and hybrid-N,D rows (default 16,4)")
    p.add_argument("--draft-study", action="store_true",
                   help="only plain-streamed and each draft (default, self-int8, self-int4, self-q8, self-q4, "
                        "the last two also without overlap and with --overlap auto) at the fixed tree "
                        "--study-tree, with each step's "
                        "time split")
    p.add_argument("--draft-auto-study", action="store_true",
                   help="only plain-streamed, each candidate draft with --tree auto (default, self-int8, self-int4, "
                        "self-q8, self-q4) and --draft auto, and a best-single row (computed: the fastest of those "
                        "candidates and plain in hindsight)")
    p.add_argument("--study-tree", default="16,6", help="the fixed Sequoia tree N,D of --draft-study (default 16,6)")
    p.add_argument("--weights", default="auto",
                   help="the format the target's streamed layers are stored in (as --weights of generate; "
                        "default auto: the checkpoint's own, e.g. the default's Q4_1 blocks; f32: a disk-bound pass)")
    p.add_argument("--hindsight", default="2,2 4,3 8,3 16,4 32,5",
                   help="fixed Sequoia trees N,D run with --auto-study (space-separated)")
    p.add_argument("--fresh-profile", action="store_true",
                   help="measure the machine's profile again before the run (the first generation is then the "
                        "first after a fresh profile)")
    p.add_argument("--modes", default=None,
                   help="run only these modes (comma-separated names as in the table, e.g. suffix,suffix-rule or "
                        "sequoia-16,16,sequoia-auto); plain-streamed always runs")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers + Accelerate row")
    p.add_argument("--separate-engines", action="store_true",
                   help="--auto-study: load an engine per mode (default: every mode but plain-control on one "
                        "engine, Engine.variant, so that modes differ in decoding only; --sequential, one mode "
                        "at a time, also loads one per mode)")
    p.add_argument("--sequential", action="store_true",
                   help="one engine at a time, each mode over all prompts (default: all engines loaded, the "
                        "modes interleaved prompt by prompt, so that noise on a shared machine hits all alike)")
    p.add_argument("--out", default=None, help="write the full results as JSON")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder (needs matplotlib: the bench extra)")


def _depth(budget: int) -> int:
    return DEPTH_FOR_BUDGET.get(budget, max(4, min(24, budget.bit_length() * 2)))


def _modes(budgets: list[int]) -> list[dict]:
    modes = [{"mode": "plain-resident", "kind": "none", "offload": "none", "draft": False},
             {"mode": "plain-streamed", "kind": "none", "draft": False}]
    for b in budgets:
        d = _depth(b)
        modes += [{"mode": f"chain-{b}", "kind": "chain", "budget": min(b, CHAIN_MAX), "depth": min(b, CHAIN_MAX)},
                  {"mode": f"specinfer-{b}", "kind": "specinfer", "budget": b, "depth": d,
                   "width": max(1, (b - 1) // (d - 1))},
                  {"mode": f"specexec-{b}", "kind": "specexec", "budget": b, "depth": d},
                  {"mode": f"sequoia-{b}", "kind": "sequoia", "budget": b, "depth": d}]
    modes.append({"mode": "sequoia-auto", "kind": "auto"})
    modes.append({"mode": "auto-no-adapt", "kind": "auto", "adapt": False})
    return modes


def _study_modes(hindsight: list[tuple[int, int]]) -> list[dict]:
    # "shared": the mode runs on one engine shared by every such mode (`Engine.variant` of the
    # auto engine), so that modes differ in decoding only: on 2 cores two identical
    # engines in one process decoded 5-20% apart, persistently, while one engine measured against
    # itself 0.99-1.00x. plain-again: plain-streamed once more on that engine, the floor under the
    # study's ratios; plain-control: plain-streamed's configuration in a second engine of its own,
    # how far two engines differ (never a variant)
    return ([{"mode": "plain-streamed", "kind": "none", "draft": False, "shared": True}]
            + [{"mode": f"sequoia-{n},{d}", "kind": "sequoia", "budget": n, "depth": d, "shared": True}
               for n, d in hindsight]
            + [{"mode": "sequoia-auto", "kind": "auto", "shared": True},
               {"mode": "auto-no-adapt", "kind": "auto", "adapt": False, "shared": True},
               {"mode": "plain-again", "kind": "control", "draft": False, "shared": True},
               {"mode": "plain-control", "kind": "control", "draft": False}])


def _variant_kwargs(m: dict) -> dict:
    """`Engine.variant`'s keywords for a mode that `_load` would load as its own engine."""
    if not m.get("draft", True):
        return {"draft": False}
    if m["kind"] == "sequoia":
        return {"tree": "sequoia", "tree_budget": m["budget"], "tree_depth": m["depth"]}
    return {"adapt": m.get("adapt", True)}


def _load_group(args, group: list[dict]) -> tuple[dict, list]:
    """{mode: engine} for a group of modes, and the engines to close. "shared" modes are variants
    of one engine loaded as --tree auto with the draft (unless --separate-engines). With a
    "draft-auto" mode (`--draft-auto-study`), the candidate it chose is measured on a variant of
    the draft-auto engine: the two rows are one configuration (the chosen draft, --tree auto, the
    same answers' length), and two engines of one configuration decode 5-20% apart on 2 cores
    (run 7: the chosen self-q8's own row 10% faster than draft-auto's; run 8: 16% slower), which
    would be read as draft auto's choice being worse or better than itself."""
    owned, engines = [], {}
    shared = [m for m in group if m.get("shared")] if not getattr(args, "separate_engines", False) else []
    try:
        if shared:
            base = _load(args, {"mode": "base", "kind": "auto"})
            owned.append(base)
            engines.update({m["mode"]: base.variant(**_variant_kwargs(m)) for m in shared})
        auto = next((m for m in group if m["mode"] == "draft-auto"), None)
        if auto is not None and not getattr(args, "separate_engines", False):
            engines["draft-auto"] = _load(args, auto)
            owned.append(engines["draft-auto"])
            chosen = f"{engines['draft-auto'].draft_choice.chosen}-auto"
            if any(m["mode"] == chosen for m in group):  # (it keeps the chosen draft should draft-auto
                engines[chosen] = engines["draft-auto"].variant()  # switch: that draft's own row still)
        for m in group:
            if m["mode"] not in engines:
                engines[m["mode"]] = _load(args, m)
                owned.append(engines[m["mode"]])
    except BaseException:
        for e in owned:
            e.close()
        raise
    return engines, owned


def _suffix_modes(n: int, d: int) -> list[dict]:
    return [{"mode": "plain-streamed", "kind": "none", "draft": False},
            {"mode": "suffix", "kind": "suffix", "draft_name": "suffix", "tree": "auto"},
            {"mode": "suffix-rule", "kind": "suffix", "draft_name": "suffix", "tree": "auto", "adapt": False},
            {"mode": "model-auto", "kind": "auto"},
            {"mode": "hybrid-auto", "kind": "auto", "draft_name": "MODEL+suffix"},
            {"mode": f"model-{n},{d}", "kind": "sequoia", "budget": n, "depth": d},
            {"mode": f"hybrid-{n},{d}", "kind": "sequoia", "budget": n, "depth": d, "draft_name": "MODEL+suffix"}]


def _draft_modes(n: int, d: int) -> list[dict]:
    fixed = {"kind": "sequoia", "budget": n, "depth": d}
    return ([{"mode": "plain-streamed", "kind": "none", "draft": False}]
            + [{"mode": name, "draft_name": name, **fixed} for name in ("default", "self-int8", "self-int4")]
            + [{"mode": name + tail, "draft_name": name, "overlap": overlap, **fixed}
               for name in ("self-q8", "self-q4")
               for tail, overlap in (("", "on"), ("-no-overlap", "off"), ("-overlap-auto", "auto"))])


DRAFT_CANDIDATES = ("default", "self-int8", "self-int4", "self-q8", "self-q4")


def _draft_auto_modes() -> list[dict]:
    return ([{"mode": "plain-streamed", "kind": "none", "draft": False}]
            + [{"mode": f"{name}-auto", "kind": "auto", "draft_name": name} for name in DRAFT_CANDIDATES]
            + [{"mode": "draft-auto", "kind": "auto", "draft_name": "auto"}])


def _load(args, m: dict):
    from offload_engine import Engine
    kw = dict(device=args.device, offload=m.get("offload", args.offload), progress=False,
              weights=getattr(args, "weights", "auto"), overlap=m.get("overlap", "auto"))
    if m.get("draft", True):
        kw.update(draft=m.get("draft_name", "MODEL").replace("MODEL", args.draft),
                  tree=m.get("tree", "auto" if m["kind"] == "auto" else m["kind"]), adapt=m.get("adapt", True))
        if m["kind"] not in ("auto", "suffix"):
            kw.update(tree_budget=m["budget"], tree_depth=m["depth"], specinfer_width=m.get("width", 4))
        else:  # the tree (and draft) chosen for this run's answers (auto --no-adapt keeps that choice)
            kw.update(plan_tokens=args.max_new_tokens)
    return Engine.load(args.target, **kw)


def _empty() -> dict:
    return {"decode_seconds": 0.0, "tokens": 0, "steps": 0, "target_passes": 0, "bytes_streamed": 0,
            "new_tokens": 0, "token_ids": [], "auto": None, "per_prompt": [], "suffix_accepted": 0,
            "suffix_matched": 0, "gate_runs": 0, "gate_skips": 0, "split": {}, "ahead_hits": 0, "ahead_misses": 0,
            "overlap_gate": {},
            "by_prompt": [], "draft_switches": []}


def decode_seconds_per_token(stats: dict) -> float:
    """A generation's decode time per token (prefill excluded: the first token comes from it)."""
    return (stats["seconds"] - stats["prefill_seconds"]) / max(1, stats["new_tokens"] - 1)


def _add(acc: dict, engine, item: dict, i: int, temperature: float, max_new_tokens: int) -> None:
    r = engine.generate(**item, max_new_tokens=max_new_tokens, temperature=temperature, seed=i)
    s = r.stats
    acc["decode_seconds"] += s["seconds"] - s["prefill_seconds"]
    acc["tokens"] += s["new_tokens"] - 1  # the first token comes from the prefill pass
    acc["by_prompt"].append(decode_seconds_per_token(s))
    acc["steps"] += s["target_steps"]
    acc["target_passes"] += s["target_passes"]
    acc["bytes_streamed"] += s["bytes_streamed"]
    acc["new_tokens"] += s["new_tokens"]
    acc["token_ids"].append(r.token_ids)
    acc["auto"] = s.get("auto")
    if s.get("draft_switch"):  # (--draft auto: another draft loaded after this answer; the user
        acc["draft_switches"].append({"prompt": i, **s["draft_switch"]})  # waits for it: it counts)
        acc["decode_seconds"] += s["draft_switch"]["seconds"]
    for k, v in (s.get("step_split") or {}).items():
        acc["split"][k] = acc["split"].get(k, 0.0) + v
    if s.get("overlap"):
        acc["ahead_hits"] += s["overlap"]["hits"]
        acc["ahead_misses"] += s["overlap"]["misses"]
        for k in ("grown_steps", "rested_steps", "gate_stops", "cost_seconds", "gain_seconds"):
            if k in s["overlap"]:  # (--overlap auto's gate)
                acc["overlap_gate"][k] = acc["overlap_gate"].get(k, 0) + s["overlap"][k]
    if s.get("suffix"):
        acc["suffix_accepted"] += s["suffix"]["accepted_tokens"]
        acc["suffix_matched"] += s["suffix"]["matched_steps"]
        acc["gate_runs"] += s["suffix"].get("gate_runs") or 0
        acc["gate_skips"] += s["suffix"].get("gate_skips") or 0
    if s.get("auto"):  # each generation: predicted at its start, forecast step by step, measured
        a = s["auto"]
        acc["per_prompt"].append({
            "prompt": i, "measured_seconds_per_token": decode_seconds_per_token(s),
            "predicted_seconds_per_token": a["predicted_seconds_per_token"], "start_tree": [a["budget"], a["depth"]],
            "forecast_seconds_per_token": a["forecast_seconds_per_token"], "trees": a["trees"],
            "tree_steps": a["tree_steps"], "tokens": s["new_tokens"]})


FORECAST_TOLERANCE = 0.10  # issue 19's bar for the predictions once adapting


def forecast_after_first(per_prompt: list[dict]) -> dict | None:
    """How true the step-by-step forecast was once adapting: over every generation after the
    first, how many forecast their s/token within FORECAST_TOLERANCE of what they measured, and
    the pooled ratio, the forecast time of their tokens over their measured time (sum of forecast
    s/token x tokens over sum of measured s/token x tokens). One short answer of a deep tree is a
    handful of steps, and even a model that is exactly right lands within 10% in only 32-53% of
    39-token answers (`benchmarks/forecast_floor.py`); the pooled ratio is what a bar can ask of."""
    later = [pp for pp in per_prompt[1:] if pp.get("forecast_seconds_per_token") and pp.get("tokens")]
    if not later:
        return None
    ratios = [pp["forecast_seconds_per_token"] / pp["measured_seconds_per_token"] for pp in later]
    pooled = (sum(pp["forecast_seconds_per_token"] * pp["tokens"] for pp in later)
              / sum(pp["measured_seconds_per_token"] * pp["tokens"] for pp in later))
    return {"answers": len(later), "within": sum(abs(r - 1.0) <= FORECAST_TOLERANCE for r in ratios),
            "tolerance": FORECAST_TOLERANCE, "ratios": ratios, "pooled": pooled}


def wanted_modes(text: str, names: list[str]) -> list[str]:
    """--modes' names, comma-separated, where a name may hold commas itself ("sequoia-16,16",
    "model-4,3"): at each place the longest run of comma-separated pieces that is a mode of the
    run, else one piece (which the caller then reports as no mode of the run)."""
    pieces = [p.strip() for p in text.split(",")]
    known, out, i = set(names), [], 0
    while i < len(pieces):
        take = next((k for k in range(len(pieces) - i, 1, -1) if ",".join(pieces[i:i + k]) in known), 1)
        name = ",".join(pieces[i:i + take])
        if name:
            out.append(name)
        i += take
    return out


def paired_ratio(reference: dict, row: dict) -> float:
    """The median over prompts of the reference's s/token over the row's on the same prompt: the
    modes run prompt by prompt, interleaved, so a slow spell of a shared machine falls on a few
    prompts of one mode, which the pooled ratio (total time over total tokens) carries whole and
    this median sets aside."""
    pairs = [a / b for a, b in zip(reference["seconds_per_token_by_prompt"], row["seconds_per_token_by_prompt"])
             if b > 0]
    return statistics.median(pairs) if pairs else float("nan")


def _finish_mode(acc: dict) -> dict:
    t, n = acc["tokens"], acc["new_tokens"]
    return {**acc, "tokens_per_step": t / acc["steps"] if acc["steps"] else 0.0,
            "seconds_per_token": acc["decode_seconds"] / t if t else float("nan"),
            "bytes_streamed_per_token": acc["bytes_streamed"] / n if n else 0.0}


def _peer(args, prompts: list[dict], max_new_tokens: int, engine) -> dict:
    """transformers + Accelerate, greedy, decoding exactly as many tokens as ours did per prompt."""
    try:
        from benchmarks.stream_bench import accelerate_per_token
        import torch
    except ImportError as e:
        return {"mode": "peer", "error": f"not run: {e}"}
    per_token, ids, n = [], [], 0
    for item in prompts:
        prompt_ids = engine.prompt_ids(**item)
        t, new = accelerate_per_token(engine.folder, prompt_ids, max_new_tokens, args.offload,
                                      torch.device(args.device), torch.float32)
        per_token.append(t)
        ids.append(new)
        n += 1
    return {"mode": "peer", "kind": f"transformers+accelerate.{'disk_offload' if args.offload == 'disk' else 'cpu_offload'}",
            "seconds_per_token": sum(per_token) / n, "token_ids": ids}


def run(args: argparse.Namespace) -> dict:
    from offload_engine.planning.adaptive import describe_trees
    from offload_engine.speculation.measure import read_prompts
    if args.plots:  # before a run of many minutes, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            from offload_engine.errors import UserError
            raise UserError("--plots needs matplotlib: pip install -e '.[bench]' (or leave --plots out)") from None
    if args.quick:
        args.limit, args.max_new_tokens, args.budgets = 3, 32, "16"
    temps = [float(t) for t in args.temperatures.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    prompts = read_prompts(args.prompts)[: args.limit]
    started = time.perf_counter()
    rows, plain_ids = [], {}
    hindsight = [tuple(int(x) for x in t.split(",")) for t in args.hindsight.split()]
    draft_auto = getattr(args, "draft_auto_study", False)
    if sum(map(bool, (args.auto_study, args.suffix_study, args.draft_study, draft_auto))) > 1:
        from offload_engine.errors import UserError
        raise UserError("--auto-study, --suffix-study, --draft-study and --draft-auto-study are separate runs: "
                        "give one")
    suffix_tree = tuple(int(x) for x in args.suffix_tree.split(","))
    modes = (_study_modes(hindsight) if args.auto_study else _suffix_modes(*suffix_tree) if args.suffix_study
             else _draft_modes(*(int(x) for x in args.study_tree.split(","))) if args.draft_study
             else _draft_auto_modes() if draft_auto else _modes(budgets))
    if args.modes:  # a subset (the baseline always runs: every ratio is against it)
        from offload_engine.errors import UserError
        wanted = set(wanted_modes(args.modes, [m["mode"] for m in modes]))
        unknown = wanted - {m["mode"] for m in modes}
        if unknown:
            raise UserError(f"--modes: no mode {', '.join(sorted(unknown))} in this run; its modes: "
                            + ", ".join(m["mode"] for m in modes))
        modes = [m for m in modes if m["mode"] in wanted | {"plain-streamed"}]
    if args.fresh_profile:
        _forget_profile(args)
    # Interleaved: prompt by prompt, every mode in turn (each prompt starting with the next mode,
    # so that no mode always runs right after another), so that a slow stretch of a shared disk
    # or CPU falls on all modes alike (the ratios are what this benchmark is for). --sequential
    # loads one engine at a time instead (a target that cannot be loaded several times over).
    groups = [[m] for m in modes] if args.sequential else [modes]
    for group in groups:
        engines, owned = _load_group(args, group)
        try:
            for t in temps:
                accs = {m["mode"]: _empty() for m in group}
                for e in engines.values():  # each temperature drafts only from its own earlier prompts
                    if e.suffix_store is not None:
                        e.suffix_store.clear()
                for i, item in enumerate(prompts):
                    for m in group[i % len(group):] + group[:i % len(group)]:  # each mode first in turn
                        _add(accs[m["mode"]], engines[m["mode"]], item, i, t, args.max_new_tokens)
                for m in group:
                    r = _finish_mode(accs[m["mode"]])
                    row = {"mode": m["mode"], "kind": m["kind"], "budget": m.get("budget", 1),
                           "depth": m.get("depth", 1), "temperature": t,
                           **{k: r[k] for k in ("tokens_per_step", "seconds_per_token", "target_passes",
                                                "bytes_streamed_per_token", "steps", "tokens")},
                           "seconds_per_token_by_prompt": r["by_prompt"]}
                    if r["steps"] and r["split"]:  # each step's time split, ms per step
                        row["split_ms_per_step"] = {k: 1e3 * v / r["steps"] for k, v in r["split"].items()}
                    if r["ahead_hits"] + r["ahead_misses"]:  # steps whose next tree was grown in the pass
                        row["ahead_hits"], row["ahead_steps"] = r["ahead_hits"], r["ahead_hits"] + r["ahead_misses"]
                    if r["overlap_gate"]:
                        row["overlap_gate"] = r["overlap_gate"]
                    if "suffix" in m.get("draft_name", ""):  # suffix drafts: tokens they gave, steps they matched
                        row["suffix_accepted_tokens"], row["suffix_matched_steps"] = (r["suffix_accepted"],
                                                                                      r["suffix_matched"])
                        if m["kind"] == "suffix" and m.get("adapt", True):  # the gate: proposals run, skipped
                            row["gate_runs"], row["gate_skips"] = r["gate_runs"], r["gate_skips"]
                    if m["kind"] == "auto" and r["auto"]:
                        row["budget"], row["depth"] = r["auto"]["budget"], r["auto"]["depth"]
                        row["predicted_seconds_per_token"] = r["auto"]["predicted_seconds_per_token"]
                        row["per_prompt"] = r["per_prompt"]
                        row["forecast_after_first"] = forecast_after_first(r["per_prompt"])
                        steps = sum((Counter(pp["tree_steps"]) for pp in r["per_prompt"]), Counter())
                        row["trees"] = describe_trees(steps)
                    row["shared_engine"] = all(e is not engines[m["mode"]] for e in owned)  # a variant
                    if m["mode"] == "draft-auto" and engines[m["mode"]].draft_choice is not None:  # its pick
                        e = engines[m["mode"]]  # (at load: a switch since changes `chosen`)
                        row["draft_chosen"] = e.draft_switches[0]["from"] if e.draft_switches else e.draft_choice.chosen
                        row["draft_switches"] = r["draft_switches"]  # (this row's, after which prompt)
                    if m["mode"] == "plain-streamed":
                        plain_ids[t] = r["token_ids"]
                    row["token_ids"] = r["token_ids"]
                    rows.append(row)
                    print(f"{m['mode']:16s} T={t:g}: {row['tokens_per_step']:.2f} tokens/step, "
                          f"{row['seconds_per_token']:.4f} s/token", file=sys.stderr, flush=True)
        finally:
            for e in owned:
                e.close()
    for t in temps:  # the best fixed choice in hindsight: plain or a fixed Sequoia tree, on these prompts
        fixed = [r for r in rows if r["temperature"] == t and r["kind"] in ("none", "sequoia")
                 and r["mode"] != "plain-resident" and "suffix_accepted_tokens" not in r]  # (model trees only)
        best = min(fixed, key=lambda r: r["seconds_per_token"])
        rows.append({**best, "mode": "best-fixed", "best_fixed_mode": best["mode"]})
    if draft_auto:  # the best single draft in hindsight: a candidate (with --tree auto) or none
        for t in temps:
            single = [r for r in rows if r["temperature"] == t and r["mode"] not in ("draft-auto", "best-fixed")]
            best = min(single, key=lambda r: r["seconds_per_token"])
            rows.append({**best, "mode": "best-single", "best_fixed_mode": best["mode"]})
    for row in rows:  # computed from the tokens, after the baseline has run
        base = next(r for r in rows if r["mode"] == "plain-streamed" and r["temperature"] == row["temperature"])
        row["speedup_vs_plain_streamed"] = base["seconds_per_token"] / row["seconds_per_token"]
        row["equal_to_plain"] = (row["token_ids"] == plain_ids[row["temperature"]]
                                 if row["temperature"] == 0 else None)
        if row["kind"] == "control":
            row["vs_plain_paired"] = paired_ratio(base, row)
        if row["kind"] == "auto":
            best = next(r for r in rows if r["mode"] == "best-fixed" and r["temperature"] == row["temperature"])
            row["vs_best_fixed"] = best["seconds_per_token"] / row["seconds_per_token"]
            row["vs_best_fixed_paired"] = paired_ratio(best, row)
            row["vs_plain_paired"] = paired_ratio(base, row)
        if row["mode"] == "draft-auto":
            best = next(r for r in rows if r["mode"] == "best-single" and r["temperature"] == row["temperature"])
            row["vs_best_single"] = best["seconds_per_token"] / row["seconds_per_token"]
            row["vs_best_single_paired"] = paired_ratio(best, row)
    peer = None
    if not args.no_peer and 0.0 in temps:
        engine = _load(args, {"mode": "plain-streamed", "kind": "none", "draft": False})
        try:
            peer = _peer(args, prompts, args.max_new_tokens, engine)
        finally:
            engine.close()
        if "error" not in peer:
            base = next(r for r in rows if r["mode"] == "plain-streamed" and r["temperature"] == 0)
            # the peer decodes max_new_tokens greedily without stopping at EOS: compare the common prefix
            peer["equal_to_plain"] = all(p[:len(b)] == b[:len(p)] for p, b in zip(peer["token_ids"], plain_ids[0.0]))
            peer["speedup_vs_plain_streamed"] = base["seconds_per_token"] / peer["seconds_per_token"]
            peer["plain_streamed_over_peer"] = peer["seconds_per_token"] / base["seconds_per_token"]
    return {"setting": {"target": args.target, "draft": args.draft, "offload": args.offload, "device": args.device,
                        "weights": getattr(args, "weights", "auto"),
                        "study": "draft" if args.draft_study else "suffix" if args.suffix_study else
                                 "auto" if args.auto_study else "draft-auto" if draft_auto else None,
                        "prompts": len(prompts), "prompts_file": str(args.prompts),
                        "max_new_tokens": args.max_new_tokens, "temperatures": temps,
                        "budgets": budgets}, "rows": rows, "peer": peer,
            "seconds": time.perf_counter() - started, "machine": _machine()}


def _forget_profile(args) -> None:
    """Delete this pair's cached profile (for this benchmark's placement), so that the next auto
    engine measures it afresh."""
    from offload_engine.planning import profiler
    engine = _load(args, {"mode": "x", "kind": "sequoia", "budget": 2, "depth": 2})
    try:
        profiler.profile_path(engine).unlink(missing_ok=True)
    finally:
        engine.close()


def _machine() -> dict:
    import os
    import platform

    import torch
    from offload_engine.planning.profiler import machine_name
    return {"machine": machine_name(torch.device("cpu")), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def markdown(res: dict) -> str:
    lines = ["| mode | T | nodes, levels | tokens/step | s/token | speed-up vs plain streamed | target passes | "
             "MB streamed/token | = plain (T=0) |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        eq = "-" if r["equal_to_plain"] is None else ("yes" if r["equal_to_plain"] else "**NO**")
        mode = r["mode"] + (f" ({r['best_fixed_mode']})" if "best_fixed_mode" in r else "")
        if "vs_best_single" in r:
            chose = f"chose {r['draft_chosen']}; " if r.get("draft_chosen") else ""
            chose += "".join(f"switched to {w['to']} after prompt {w['prompt'] + 1}; "
                             for w in r.get("draft_switches") or [])
            mode += (f": {r['vs_best_single']:.2f}x the best single draft (per prompt, median "
                     f"{r['vs_best_single_paired']:.2f}x); {chose}{r.get('trees', 'plain decoding')}")
        elif r["kind"] == "control":
            where = "the same engine" if r.get("shared_engine") else "a second engine"
            mode += (f": plain-streamed run again, {where} ({r['speedup_vs_plain_streamed']:.2f}x; per prompt, "
                     f"median {r['vs_plain_paired']:.2f}x): the run's noise floor")
        elif "vs_best_fixed" in r:
            mode += (f": {r['vs_best_fixed']:.2f}x best fixed (per prompt, median {r['vs_best_fixed_paired']:.2f}x; "
                     f"{r['vs_plain_paired']:.2f}x plain); {r['trees']}")
        if "suffix_accepted_tokens" in r:
            mode += f" ({r['suffix_accepted_tokens']} tokens from suffix drafts"
            mode += (f"; {r['gate_runs']} proposals run, {r['gate_skips']} skipped)" if "gate_runs" in r else ")")
        lines.append(f"| {mode} | {r['temperature']:g} | {r['budget']}, {r['depth']} | {r['tokens_per_step']:.2f} | "
                     f"{r['seconds_per_token']:.4f} | {r['speedup_vs_plain_streamed']:.2f}x | {r['target_passes']} | "
                     f"{r['bytes_streamed_per_token'] / 1e6:.1f} | {eq} |")
    p = res.get("peer")  # (a row of the first table)
    if p and "error" not in p:
        lines.append(f"| peer: {p['kind']} | 0 | - | 1.00 | {p['seconds_per_token']:.4f} | "
                     f"{p['speedup_vs_plain_streamed']:.2f}x | - | - | {'yes' if p['equal_to_plain'] else '**NO**'} |")
    elif p:
        lines.append(f"| peer | 0 | - | - | - | - | - | - | {p['error']} |")
    split = [r for r in res["rows"] if "split_ms_per_step" in r and r["mode"] not in ("best-fixed", "best-single")]
    if split:  # where each step's time went
        lines += ["", "| mode | T | draft before the pass (ms/step) | draft overlapped (in the pass) | pass (without it) "
                      "| rest | next tree grown ahead and used |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in split:
            sp = r["split_ms_per_step"]
            used = f"{r['ahead_hits']} of {r['ahead_steps']} steps" if "ahead_steps" in r else "-"
            if r.get("overlap_gate"):
                g = r["overlap_gate"]
                used += (f"; gate: grew in {g['grown_steps']}, rested {g['rested_steps']}, cost "
                         f"{1e3 * g['cost_seconds']:.0f} ms, levels used worth {1e3 * g['gain_seconds']:.0f} ms")
            lines.append(f"| {r['mode']} | {r['temperature']:g} | {sp['draft_before_pass']:.1f} | "
                         f"{sp['draft_overlapped']:.1f} | {sp['target_pass']:.1f} | {sp['rest']:.1f} | {used} |")
    told = [r for r in res["rows"] if r.get("per_prompt") and r["mode"] != "best-fixed"]
    if told:  # issue 19's second bar: the first generation's prediction, then the forecast once adapting
        lines += ["", "| mode | T | first generation: predicted / measured | after it: forecast / measured, "
                      "each | within 10% | pooled |", "|---|---|---:|---|---:|---:|"]
        for r in told:
            first = r["per_prompt"][0]
            f = r.get("forecast_after_first")
            each = ", ".join(f"{x - 1:+.0%}" for x in f["ratios"]) if f else "-"
            within = f"{f['within']} of {f['answers']}" if f else "-"
            pooled = f"{f['pooled'] - 1:+.1%}" if f else "-"
            start = first["predicted_seconds_per_token"] / first["measured_seconds_per_token"] - 1
            lines.append(f"| {r['mode']} | {r['temperature']:g} | {start:+.1%} | {each} | {within} | {pooled} |")
    return "\n".join(lines)


def plots(res: dict, folder: Path) -> list[Path]:
    """tokens/step and speed-up against the tree budget, one line per tree kind, auto marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    if any(r["kind"] == "suffix" for r in res["rows"]):
        return [_mode_bars(res, folder, plt, "suffix_study.png")]
    if res["setting"].get("study") == "draft":
        return [_mode_bars(res, folder, plt, "draft_study.png")]
    if res["setting"].get("study") == "draft-auto":
        return [_mode_bars(res, folder, plt, "draft_auto_study.png")]
    for key, label, name in (("tokens_per_step", "tokens per step", "tokens_per_step.png"),
                             ("speedup_vs_plain_streamed", "speed-up over plain streamed decoding", "speedup.png")):
        fig, axes = plt.subplots(1, len(res["setting"]["temperatures"]), figsize=(11, 4), squeeze=False)
        for ax, t in zip(axes[0], res["setting"]["temperatures"]):
            rows = [r for r in res["rows"] if r["temperature"] == t and r["mode"] not in ("best-fixed", "best-single")]
            for kind in ("sequoia", "specexec", "specinfer", "chain"):
                pts = sorted((r["budget"], r[key]) for r in rows if r["kind"] == kind)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=kind)
            for r in rows:
                if r["kind"] == "auto":
                    ax.scatter([r["budget"]], [r[key]], marker="*", s=200, color="black", zorder=5,
                               label=f"auto ({r['budget']}, {r['depth']})")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tree budget (nodes)")
            ax.set_ylabel(label)
            ax.set_title(f"T={t:g}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


def _mode_bars(res: dict, folder: Path, plt, name: str) -> Path:
    """--suffix-study, --draft-study: tokens/step and speed-up per mode, bars side by side per temperature."""
    temps = res["setting"]["temperatures"]
    modes = [r["mode"] for r in res["rows"] if r["temperature"] == temps[0] and r["mode"] not in ("best-fixed", "best-single")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, label in ((axes[0], "tokens_per_step", "tokens per step"),
                           (axes[1], "speedup_vs_plain_streamed", "speed-up over plain streamed decoding")):
        width = 0.8 / len(temps)
        for k, t in enumerate(temps):
            vals = [next(r[key] for r in res["rows"] if r["mode"] == m and r["temperature"] == t) for m in modes]
            ax.bar([i + k * width for i in range(len(modes))], vals, width, label=f"T={t:g}")
        ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(modes))], modes, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(Path(res["setting"].get("prompts_file", "")).name)
    fig.tight_layout()
    path = folder / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    args = p.parse_args(argv)
    return report(run(args), args)


def report(res: dict, args) -> int:
    if args.out:  # (first: a report that fails to print loses nothing measured)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(markdown(res))
    print(f"\n{res['setting']['prompts']} prompts x {res['setting']['max_new_tokens']} new tokens, "
          f"{res['seconds'] / 60:.1f} min on {res['machine']['machine']}, {res['machine']['date']}")
    if args.plots:
        for path in plots(res, Path(args.plots)):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
