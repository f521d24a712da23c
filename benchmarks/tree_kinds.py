"""Tokens per step of each tree kind at the same budget, on the embedded default target.

    python benchmarks/tree_kinds.py [--budget 32] [--depth 6] [--bits 4] [--prompts N] [--json out.json]

Until distilled drafts exist (issue 5), the draft is the target with its linear weights rounded
to a `--bits`-bit group-wise grid (group 32), held in fp32: a stand-in for a low-bit self-draft
whose acceptance is high but not perfect. Both run resident; tokens per step does not depend on
where the target's layers live.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fake_quantise_(model, bits: int, group: int = 32) -> None:
    """Round every projection weight in place to a symmetric `bits`-bit grid per group of `group`."""
    import torch
    levels = 2 ** (bits - 1) - 1
    for layer in model.layers:
        for name, w in layer.items():
            if name.endswith("proj.weight"):
                g = w.view(-1, group)
                scale = g.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / levels
                g.copy_(torch.round(g / scale).clamp(-levels, levels) * scale)


def main(argv: list[str] | None = None) -> int:
    from offload_engine import Engine
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    prompts = [json.loads(line)["messages"] for line in
               (Path(__file__).parent / "prompts.jsonl").read_text().splitlines()[: args.prompts]]
    kinds = {"sequoia": {}, "specexec": {}, "chain": {"tree_depth": args.budget},  # a chain of `budget` nodes
             "specinfer": {"specinfer_width": max(1, (args.budget - 1) // (args.depth - 1))}}
    rows = []
    for temperature in (0.0, 0.6):
        for kind, extra in kinds.items():
            kw = {"tree_budget": args.budget, "tree_depth": args.depth, **extra}  # extra overrides
            engine = Engine.load("default", device="cpu", offload="none", draft="default", tree=kind, progress=False,
                                 **kw)
            fake_quantise_(engine.draft, args.bits)
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
        Path(args.json).write_text(json.dumps({"bits": args.bits, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
