"""How much a pair's acceptance moves from one prompt to the next: the prior of the range printed
beside a first answer's predicted speed-up (`auto_tree.speedup_spread`'s tau).

    python benchmarks/prompt_spread.py --draft self-q8 [--temperature 0] [--offload disk]
        [--prompts 16] [--max-new-tokens 64] [--budget 16] [--depth 16] [--json out.json]

One answer per prompt (benchmarks/prompts.jsonl, the first `--prompts`, then the demo's prompt)
with a fixed Sequoia tree; each answer's rank-1 evidence (`result.stats["rank_evidence"]`: the
first rank tried and accepted along its accepted paths) is one count. tau is the standard
deviation of the prompts' rank-1 log-odds beyond their binomial noise, fitted by maximum
likelihood with the upper end of its 90% interval (`sequoia_trees.acceptance.prompt_tau`); the
script prints them with each prompt's counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fixed_tree import add_args, answers  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap, prompts=16, max_new_tokens=64, budget=16)
    args = ap.parse_args(argv)
    from sequoia_trees.acceptance import prompt_tau
    from offload_engine.apps.cli import DEMO_PROMPT
    from offload_engine.speculation.measure import read_prompts
    prompts = read_prompts(Path(__file__).parent / "prompts.jsonl")[: args.prompts]
    prompts.append({"messages": [{"role": "user", "content": DEMO_PROMPT}]})
    rows = []
    t0 = time.perf_counter()
    for i, r in answers(args, prompts):
        ev = r.stats["rank_evidence"]
        rows.append({"prompt": i, "tried": int(ev["at_risk"][0]), "accepted": int(ev["accepted"][0]),
                     "tokens_per_step": round(r.stats["tokens_per_step"], 3), "new_tokens": r.stats["new_tokens"]})
        print(f"  prompt {i:2d}: rank 1 {rows[-1]['accepted']}/{rows[-1]['tried']}, "
              f"{rows[-1]['tokens_per_step']:.2f} tokens a step", flush=True)
    tau = prompt_tau([(r["tried"], r["accepted"]) for r in rows])
    tried, accepted = sum(r["tried"] for r in rows), sum(r["accepted"] for r in rows)
    print(f"{args.draft}, T={args.temperature:g}, ({args.budget}, {args.depth}), {len(rows)} prompts: rank 1 "
          f"{accepted}/{tried} = {accepted / max(tried, 1):.3f} pooled; tau = "
          f"{'n/a' if tau is None else f'{tau[0]:.2f} (90%: at most {tau[1]:.2f})'} "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        out = {"draft": args.draft, "temperature": args.temperature, "offload": args.offload,
               "tree": [args.budget, args.depth], "max_new_tokens": args.max_new_tokens,
               "tau": None if tau is None else tau[0], "tau_upper_90": None if tau is None else tau[1],
               "prompts": rows, "date": time.strftime("%Y-%m-%d")}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
