"""Is a miss of the simulator's prediction a bias of the profile's steps, or the machine's speed
moving? One process, one engine, one fixed Sequoia tree, rounds that take turns:

  generate  real greedy generations of benchmarks/prompts.jsonl (the steps a user runs), their
            step parts (draft before the pass, the pass, the rest): means per step over the
            round (about 30 s), and the median step;
  profile   steps like the profile's (`profiler._time_steps`: a fresh decoder on 128 random
            tokens, the tree generate runs, shaped by the pair's stored vector; but ten steps of
            one shape on one decoder, where the profile interleaves shapes and modes), medians
            of their parts (about 5 s);
  compute   a pure-compute probe (a 64 x 576 by 576 x 1536 matmul, the draft's shape), matmuls
            per second in 1.5 s blocks: the machine's compute speed with no disk read at all.

If generate's pass runs slower than the profile kind's in every round, the profile is biased; if
both move together from round to round, it is the machine.

    python benchmarks/step_drift.py [--tree 64,8] [--rounds 3] [--prompts 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def generate_round(engine, prompts, max_new_tokens: int) -> dict:
    """Per-step means of the parts over the round (as a run's s/token averages them), and the
    median step (as the profile takes medians)."""
    parts = dict(draft=0.0, target=0.0, rest=0.0, total=0.0)
    steps, each = 0, []
    for item in prompts:
        s = engine.generate(**item, max_new_tokens=max_new_tokens, temperature=0.0).stats
        split = s["step_split"]
        parts["draft"] += split["draft_before_pass"]
        parts["target"] += split["target_pass"] + split["draft_overlapped"]
        parts["rest"] += split["rest"]
        parts["total"] += sum(s["step_seconds"])
        steps += s["target_steps"]
        each += s["step_seconds"]
    return ({k: v / max(1, steps) for k, v in parts.items()}
            | {"steps": steps, "median_step": statistics.median(each) if each else 0.0})


def profile_round(engine, g, ids: list[int], steps: int = 8) -> dict:
    """Steps as the profile times them (a fresh decoder, 128 random tokens, the engine's tree);
    the first two untimed (first-use allocations), medians of the rest."""
    from sequoia_trees.sampling import SamplingParams
    from offload_engine.speculation.decoder import SpeculativeDecoder, TreeSpec
    spec = engine.tree
    if engine.stored_acceptance:  # the tree generate runs: shaped by the pair's vector nearest T=0
        from dataclasses import replace
        from offload_engine.speculation.acceptance_store import nearest
        spec = replace(spec, acceptance=nearest(engine.stored_acceptance, 0.0)[0])
    dec = SpeculativeDecoder(engine.model, engine.draft, TreeSpec(), SamplingParams(0.0, 1.0), g,
                             len(ids) + (steps + 2) * (spec.depth + 1) + 16, max_nodes=spec.max_nodes,
                             timed=True, overlap=engine.overlap)
    dec.prefill(ids, engine.max_batch_tokens)
    dec.set_spec(spec)
    root = ids[-1]
    got = dict(draft=[], target=[], rest=[], total=[])
    for i in range(steps + 2):
        t0 = time.perf_counter()
        root = dec.step(root).tokens[-1]
        whole = time.perf_counter() - t0
        if i >= 2:
            t = dec.last_times
            for k, v in (("draft", t.draft), ("target", t.target), ("rest", t.rest), ("total", whole)):
                got[k].append(v)
    return {k: statistics.median(v) for k, v in got.items()} | {"steps": steps}


def compute_probe(seconds: float = 6.0, block: float = 1.5) -> list[float]:
    import torch
    a, x = torch.randn(576, 1536), torch.randn(64, 576)
    rates = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < block:
            for _ in range(50):
                torch.mm(x, a)
            n += 50
        rates.append(n / (time.perf_counter() - t0))
    return rates


def main(argv=None) -> int:
    import torch
    from offload_engine import Engine
    from offload_engine.speculation.measure import read_prompts
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", default="64,8", help="N,D of the fixed Sequoia tree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--draft", default="default")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    n, d = (int(x) for x in args.tree.split(","))
    prompts = read_prompts(ROOT / "benchmarks" / "prompts.jsonl")[: args.prompts]
    engine = Engine.load("default", tree="sequoia", tree_budget=n, tree_depth=d, progress=False,
                         device="cpu", offload="disk", draft=args.draft)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.config.vocab_size, (128,), generator=g).tolist()
    engine.generate(**prompts[0], max_new_tokens=8, temperature=0.0)  # (first-use allocations, untimed)
    rounds = []
    for r in range(args.rounds):
        row = {"round": r + 1, "generate": generate_round(engine, prompts, args.max_new_tokens),
               "profile_kind": profile_round(engine, g, ids), "compute_per_s": compute_probe()}
        rounds.append(row)
        gen, prof, rates = row["generate"], row["profile_kind"], row["compute_per_s"]
        print(f"round {r + 1}: generate: draft {gen['draft']:.3f} s, pass {gen['target']:.3f} s, step "
              f"{gen['total']:.3f} s, median step {gen['median_step']:.3f} s ({gen['steps']} steps); profile kind: draft {prof['draft']:.3f} s, pass "
              f"{prof['target']:.3f} s, step {prof['total']:.3f} s; compute probe {min(rates):.0f}-"
              f"{max(rates):.0f} matmuls/s", flush=True)
    engine.close()
    ratios = [r["generate"]["target"] / r["profile_kind"]["target"] for r in rounds]
    print("generate's pass / the profile kind's pass, by round: " + ", ".join(f"{x:.2f}" for x in ratios))
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": [n, d], "rounds": rounds, "pass_ratio": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
