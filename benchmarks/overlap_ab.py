"""`--overlap on`, `off` and `auto` (the gate) side by side on one fixed tree: an engine of
the embedded pair (self-q8, the target streamed from disk) with a variant per mode, the same
prompts greedy, the modes interleaved prompt by prompt in a shuffled order (seeded), two rounds;
each mode keeps its own memory of the fit rule (`LayerExecutor.fit_memory`), so that no mode
starts from another's unit durations. `on-unfitted` is `on` without
the CPU's fit rule (every unit of draft work runs until the layer waited for is in:
`LayerExecutor.fit_units`), each unit counted on to end before its own layer is in;
`on-slack` is `on` with a unit let end in the slack the next layer's wait leaves
(`LayerExecutor.fit_slack`, off by default).
Prints per mode the means of s/token, the pass (with the draft work done inside it), the draft's
part before the pass and the work inside the pass (ms), what the wait work delayed the layers by
(the overrun), the pass and the draft's part before it against `off`'s, the speed against
`off`, and the gate's counts; `--json F` writes them.

    python benchmarks/overlap_ab.py [--tree 4,4] [--draft self-q8] [--weights auto|f32|...]
        [--modes on,on-slack,on-unfitted,off,auto] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
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
    p.add_argument("--weights", default="auto", help="the format the target's streamed layers are stored in")
    p.add_argument("--modes", default="on,off,auto", help="of on, on-slack, on-unfitted, off and auto; off is always run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "off" not in modes:
        modes.append("off")
    if not set(modes) <= {"on", "on-slack", "on-unfitted", "off", "auto"}:
        p.error(f"--modes: of on, on-slack, on-unfitted, off and auto, not {args.modes!r}")
    from offload_engine import Engine
    from offload_engine.formats.default_model import default_model_dir
    n, d = (int(x) for x in args.tree.split(","))
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.limit]
    # one engine, a variant per mode: two engines loaded side by side on a 2-core machine
    # decode 5-20% apart (`Engine.variant`), where what is measured here is a few percent
    base = Engine.load(default_model_dir(), draft=args.draft, offload="disk", tree="sequoia", tree_budget=n,
                       tree_depth=d, overlap="on", weights=args.weights, progress=False)
    engines = {m: base.variant(overlap=m.split("-")[0]) for m in modes}
    layers = base.model.layers
    from offload_engine.runtime.streamer import FitMemory
    memory = {m: FitMemory() for m in modes}
    order = random.Random(0)
    res = {m: {"s_per_token": [], "pass": [], "draft_before_pass": [], "draft_inside_pass": [], "overrun": []}
           for m in engines}
    gate: dict = {}
    try:
        for _ in range(2):
            for item in prompts:
                for m in order.sample(modes, len(modes)):
                    before = layers.snapshot().idle_overrun_seconds
                    layers.fit_units, layers.fit_slack = m != "on-unfitted", m == "on-slack"
                    layers.fit_memory = memory[m]
                    st = engines[m].generate(**item, max_new_tokens=args.max_new_tokens, temperature=0.0).stats
                    layers.fit_units, layers.fit_slack = True, False
                    res[m]["overrun"].append((layers.snapshot().idle_overrun_seconds - before) / st["target_steps"])
                    sp, k = st["step_split"], st["target_steps"]
                    res[m]["s_per_token"].append((st["seconds"] - st["prefill_seconds"]) / (st["new_tokens"] - 1))
                    res[m]["pass"].append((sp["target_pass"] + sp["draft_overlapped"]) / k)
                    res[m]["draft_before_pass"].append(sp["draft_before_pass"] / k)
                    res[m]["draft_inside_pass"].append(sp["draft_overlapped"] / k)
                    if m == "auto":
                        for key in ("grown_steps", "rested_steps", "gate_stops", "cost_seconds", "gain_seconds"):
                            gate[key] = gate.get(key, 0) + st["overlap"][key]
    finally:
        base.close()
    rows = {m: {k: statistics.mean(v) for k, v in r.items()} for m, r in res.items()}
    off = rows["off"]
    for m, r in rows.items():
        ratios = {"pass_vs_off": r["pass"] / off["pass"],
                  "draft_before_pass_vs_off": r["draft_before_pass"] / off["draft_before_pass"],
                  "speed_vs_off": off["s_per_token"] / r["s_per_token"]}
        print(f"({n},{d}) {m:>11}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in r.items())
              + f"; pass {ratios['pass_vs_off']:.3f}x off's, draft before it {ratios['draft_before_pass_vs_off']:.3f}x"
              + f", {ratios['speed_vs_off']:.3f}x off's speed")
        r.update(ratios)
    print(f"gate: {gate}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tree": [n, d], "draft": args.draft, "weights": args.weights,
                                               "rows": rows, "gate": gate,
                                               "machine": _machine()}, indent=1))
    return 0


def _machine() -> dict:
    from benchmarks.latency import _machine as machine
    return machine()


if __name__ == "__main__":
    sys.exit(main())
