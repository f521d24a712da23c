"""Two engines or one: how far two identical plain engines loaded in one process decode apart,
against one engine measured against itself (why `latency.py --auto-study` runs its modes on one
engine, `Engine.variant`).

    python benchmarks/engine_pair.py [--engines 2] [--repeats 2] [--prompts FILE] [--limit 6]
                                     [--max-new-tokens 40] [--json out.json]

Labels A and B take turns prompt by prompt (the order alternating) for `--repeats` rounds. With
`--engines 2` each label is its own engine (`Engine.load("default", draft=None, offload="disk")`,
twice); with `--engines 1` both labels are one engine. It prints each label's median s/token and
the median over generations of A's s/token over B's on the same prompt (1.00 = alike).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent


def run(args) -> dict:
    from benchmarks.latency import decode_seconds_per_token
    from offload_engine import Engine
    from offload_engine.speculation.measure import read_prompts
    prompts = read_prompts(args.prompts)[: args.limit]
    engines = [Engine.load(args.target, device="cpu", offload="disk", draft=None, tree="none", progress=False)
               for _ in range(args.engines)]
    try:
        times = {"A": [], "B": []}
        for r in range(args.repeats):
            for i, item in enumerate(prompts):
                for label in ("AB" if (r + i) % 2 == 0 else "BA"):
                    engine = engines[0 if label == "A" or args.engines == 1 else 1]
                    s = engine.generate(**item, max_new_tokens=args.max_new_tokens, temperature=0.0, seed=i).stats
                    times[label].append(decode_seconds_per_token(s))
    finally:
        for e in engines:
            e.close()
    ratios = [a / b for a, b in zip(times["A"], times["B"])]
    return {"engines": args.engines, "generations_per_label": len(ratios),
            "seconds_per_token_a": statistics.median(times["A"]), "seconds_per_token_b": statistics.median(times["B"]),
            "a_over_b_median": statistics.median(ratios), "a_over_b": ratios}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--engines", type=int, choices=(1, 2), default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts_shift.jsonl"))
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = run(args)
    print(f"{res['engines']} engine(s): A {res['seconds_per_token_a']:.4f} s/token, B {res['seconds_per_token_b']:.4f}; "
          f"A/B per generation, median {res['a_over_b_median']:.3f} "
          f"(range {min(res['a_over_b']):.3f}-{max(res['a_over_b']):.3f}, {res['generations_per_label']} pairs)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
