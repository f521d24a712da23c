"""Tokens per step of each tree kind at the same budget, on the embedded default target.

    python benchmarks/tree_kinds.py [--budget 32] [--depth 6] [--draft self-int4] [--prompts N] [--json out.json]

The draft is `--draft` (default self-int4: the target's layers quantised to 4 bits, whose
acceptance is high but not perfect). Both run resident; tokens per step does not depend on where
the target's layers live. Every tree kind gets the same generic acceptance vector for Sequoia's
shape (`--acceptance` to give a measured one), so that the comparison is of tree kinds alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from offload_engine import Engine
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--draft", default="self-int4")
    p.add_argument("--acceptance", default=None, help="acceptance vector JSON shaping the sequoia tree")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    prompts = [json.loads(line)["messages"] for line in
               (Path(__file__).parent / "prompts.jsonl").read_text().splitlines()[: args.prompts]]
    kinds = {"sequoia": {}, "specexec": {}, "chain": {"tree_depth": args.budget},  # a chain of `budget` nodes
             "specinfer": {"specinfer_width": max(1, (args.budget - 1) // (args.depth - 1))}}
    acceptance = None
    if args.acceptance:
        from sequoia_trees.acceptance import AcceptanceVector
        acceptance = AcceptanceVector.from_json(Path(args.acceptance).read_text())
    rows = []
    for temperature in (0.0, 0.6):
        for kind, extra in kinds.items():
            kw = {"tree_budget": args.budget, "tree_depth": args.depth, **extra}  # extra overrides
            engine = Engine.load("default", device="cpu", offload="none", draft=args.draft, tree=kind,
                                 acceptance=acceptance, progress=False, **kw)
            engine.stored_acceptance = {}  # the same vector for every run, stored or not
            new, steps = 0, 0
            for i, messages in enumerate(prompts):
                s = engine.generate(messages=messages, max_new_tokens=args.max_new_tokens, temperature=temperature,
                                    seed=i).stats
                new += s["new_tokens"] - 1
                steps += s["target_steps"]
            nodes = engine.tree.max_nodes
            engine.close()
            rows.append({"tree": kind, "temperature": temperature, "nodes": nodes, "depth": engine.tree.depth,
                         "tokens_per_step": new / max(steps, 1), "steps": steps})
            print(f"T={temperature} {kind:9s} {nodes:3d} nodes: {new / max(steps, 1):.2f} tokens/step ({steps} steps)",
                  flush=True)
    print("\n| T | tree | nodes | levels | tokens/step |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['temperature']} | {r['tree']} | {r['nodes']} | {r['depth']} | {r['tokens_per_step']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"draft": args.draft, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
