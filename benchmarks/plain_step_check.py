"""Does the profile's plain step read high or low against steady plain decoding? One process: the
engine loaded with `--tree auto` (default pair, target streamed from disk), its profile (measured
afresh with --force), then plain greedy generations of four prompts of benchmarks/prompts.jsonl,
twice; each generation's step times after its first two, their median, against the profile's
plain step (its one-token pass plus the fitted constant).

    python benchmarks/plain_step_check.py [--force] [--draft default]
"""

from __future__ import annotations

import argparse
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
    args = p.parse_args(argv)
    prompts = read_prompts(ROOT / "benchmarks" / "prompts.jsonl")[:4]
    engine = Engine.load("default", tree="auto", adapt=False, progress=False, device="cpu", offload="disk",
                         draft=args.draft, plan_tokens=48)
    prof, _, _ = profiler.cached_or_measured(engine, progress=False, force=args.force)
    predicted = prof.timings(greedy=True).plain()
    print(f"the profile's plain step (greedy): {predicted:.4f} s")
    for rep in range(2):
        medians = [statistics.median(engine.generate(**item, max_new_tokens=24, temperature=0.0,
                                                     plain=True).stats["step_seconds"][2:]) for item in prompts]
        measured = statistics.median(medians)
        print(f"plain generations, repeat {rep + 1}: {measured:.4f} s a step (by prompt: "
              + ", ".join(f"{m:.4f}" for m in medians) + f"); the profile {predicted / measured - 1:+.1%}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
