"""Is Sequoia's acceptance model right about depth? Real steps of a fixed Sequoia tree, and the
hazard of the first rank counted by the node's depth and by how its parent was accepted.

    python benchmarks/acceptance_by_depth.py --draft self-q8 [--temperature 0] [--offload disk]
        [--prompts 10] [--max-new-tokens 128] [--budget 32] [--depth 16] [--json out.json]

Sequoia's model takes the chance that a node's rank-r child is accepted (ranks below it
rejected) as the same at every depth and whatever happened above. Along each step's accepted
path, every node with children is one trial of its first child (`path_evidence`); the table
gives, per depth of that node (0: the root) and per state (R: the root; A: a node accepted as
its parent's first child; B: accepted at a later rank), the first rank's hazard, accepted /
tried. Acceptance that comes in runs would show as hazards rising with depth, or A above R.
The prompts: benchmarks/prompts.jsonl, the first `--prompts`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fixed_tree import add_args, answers  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, prompts=10, max_new_tokens=128, budget=32)
    ap.add_argument("--deepest", type=int, default=6, help="depths from this one on are counted together")
    args = ap.parse_args(argv)
    from sequoia_trees.acceptance import path_evidence
    from offload_engine.speculation import decoder as dec
    from offload_engine.speculation.measure import read_prompts
    paths = []  # (parents, accepted, ranks) of every step
    real_step = dec.SpeculativeDecoder.step

    def step(self, root):
        result = real_step(self, root)
        v = self.last_model_verify
        if self.parents is not None and len(self.parents) > 1 and v is not None:
            paths.append((self.parents, list(v.accepted), list(v.accepted_ranks)))
        return result
    dec.SpeculativeDecoder.step = step
    prompts = read_prompts(Path(__file__).parent / "prompts.jsonl")[: args.prompts]
    for _ in answers(args, prompts):
        pass
    by_depth, by_state = {}, {}
    for parents, accepted, ranks in paths:
        for i, (children, rank) in enumerate(path_evidence(parents, accepted, ranks)):
            state = "R" if i == 0 else "A" if ranks[i - 1] == 0 else "B"
            for key, table in ((min(i, args.deepest), by_depth), (state, by_state)):
                tried, ok = table.get(key, (0, 0))
                table[key] = (tried + 1, ok + (rank == 0))
    steps = len(paths)
    print(f"{args.draft}, T={args.temperature:g}, {args.offload}, ({args.budget}, {args.depth}) trees, {steps} steps")
    for name, table in (("depth", by_depth), ("state", by_state)):
        print(f"  by {name}: " + ", ".join(f"{k}{'+' if name == 'depth' and k == args.deepest else ''}: "
                                          f"{ok}/{n} = {ok / n:.3f}" for k, (n, ok) in sorted(table.items(), key=str)))
    if args.json:
        out = {"draft": args.draft, "temperature": args.temperature, "offload": args.offload, "steps": steps,
               "tree": [args.budget, args.depth], "prompts": args.prompts,
               "by_depth": {str(k): v for k, v in sorted(by_depth.items())},
               "by_state": {k: v for k, v in sorted(by_state.items())}}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
