"""`--overlap on`, `off` and `auto` (the gate) side by side on one fixed tree: three engines of
the embedded pair (self-q8, the target streamed from disk), the same prompts greedy, the modes
interleaved prompt by prompt, two rounds. Prints per mode the means of s/token, the pass (with
the draft work done inside it), the draft's part before the pass and the work inside the pass
(ms), the speed against `off`, and the gate's counts; `--json F` writes them.

    python benchmarks/overlap_ab.py [--tree 4,4] [--draft self-q8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default="4,4")
    p.add_argument("--draft", default="self-q8")
    p.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts_shift.jsonl"))
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from offload_engine import Engine
    from offload_engine.formats.default_model import default_model_dir
    n, d = (int(x) for x in args.tree.split(","))
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.limit]
    engines = {m: Engine.load(default_model_dir(), draft=args.draft, offload="disk", tree="sequoia", tree_budget=n,
                              tree_depth=d, overlap=m, progress=False) for m in ("on", "off", "auto")}
    res = {m: {"s_per_token": [], "pass": [], "draft_before_pass": [], "draft_inside_pass": []} for m in engines}
    gate: dict = {}
    try:
        for _ in range(2):
            for i, item in enumerate(prompts):
                modes = list(engines)
                for m in modes[i % 3:] + modes[:i % 3]:
                    st = engines[m].generate(**item, max_new_tokens=args.max_new_tokens, temperature=0.0).stats
                    sp, k = st["step_split"], st["target_steps"]
                    res[m]["s_per_token"].append((st["seconds"] - st["prefill_seconds"]) / (st["new_tokens"] - 1))
                    res[m]["pass"].append((sp["target_pass"] + sp["draft_overlapped"]) / k)
                    res[m]["draft_before_pass"].append(sp["draft_before_pass"] / k)
                    res[m]["draft_inside_pass"].append(sp["draft_overlapped"] / k)
                    if m == "auto":
                        for key in ("grown_steps", "rested_steps", "gate_stops", "cost_seconds", "gain_seconds"):
                            gate[key] = gate.get(key, 0) + st["overlap"][key]
    finally:
        for e in engines.values():
            e.close()
    rows = {m: {k: statistics.mean(v) for k, v in r.items()} for m, r in res.items()}
    for m, r in rows.items():
        r["speed_vs_off"] = rows["off"]["s_per_token"] / r["s_per_token"]
        print(f"({n},{d}) {m:>4}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in r.items() if k != "speed_vs_off")
              + f"; {r['speed_vs_off']:.3f}x off")
    print(f"gate: {gate}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": [n, d], "draft": args.draft, "rows": rows, "gate": gate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
