"""Does the profile's plain step read high or low against steady plain decoding? One process: the
engine loaded with `--tree auto` (default pair, target streamed from disk), its profile (measured
afresh with --force), then plain greedy generations of four prompts of benchmarks/prompts.jsonl,
twice; each generation's step times after its first two, their median, against the profile's
plain step (its one-token pass plus the fitted constant).

    python benchmarks/plain_step_check.py [--force] [--draft default] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from offload_engine import Engine
    from offload_engine.planning import profiler
    from offload_engine.speculation.measure import read_prompts
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--force", action="store_true", help="measure the profile afresh")
    p.add_argument("--draft", default="default")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    prompts = read_prompts(ROOT / "benchmarks" / "prompts.jsonl")[:4]
    engine = Engine.load("default", tree="auto", adapt=False, progress=False, device="cpu", offload="disk",
                         draft=args.draft, plan_tokens=48)
    check = None
    if args.force:  # (the load measured a profile already when none was cached: this one is fresher)
        prof, _, _ = profiler.cached_or_measured(engine, progress=False, force=True)
        predicted = prof.timings(greedy=True).plain()
    else:  # the prediction the engine makes: its T=0 plan's step model (rescaled by its load's check)
        check = engine.speed_check
        if check is not None:
            print(check.describe())
        predicted = engine.auto_plans[min(engine.auto_plans)].timings.plain()
    print(f"the profile's plain step (greedy): {predicted:.4f} s")
    out = {"force": args.force, "speed_check": None if check is None else check.as_dict(),
           "predicted_plain_step_s": predicted, "repeats": []}
    for rep in range(2):
        medians = []
        for item in prompts:
            steps = engine.generate(**item, max_new_tokens=24, temperature=0.0, plain=True).stats["step_seconds"]
            if len(steps) > 2:  # (an answer that ended within three tokens times nothing steady)
                medians.append(statistics.median(steps[2:]))
        if not medians:
            print("no prompt made more than three steps")
            continue
        measured = statistics.median(medians)
        out["repeats"].append({"measured_plain_step_s": measured, "by_prompt": medians})
        print(f"plain generations, repeat {rep + 1}: {measured:.4f} s a step (by prompt: "
              + ", ".join(f"{m:.4f}" for m in medians) + f"); the profile {predicted / measured - 1:+.1%}")
    engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
