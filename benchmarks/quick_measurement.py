"""`--tree auto`'s quick acceptance measurement, the one-level tree it used until 2026-12-05
against the deep measuring tree it uses now, on the embedded pair, each against the pair's
stored vector (40 prompts x 96 tokens, 921-2101 steps: the reference).

    python benchmarks/quick_measurement.py [--drafts self-q8,default] [--offload disk]
                                           [--seeds 0,1] [--json out.json]

Per draft, temperature (0 and 0.6; T=0.6 once per seed) and way: seconds, target steps, the
first rank's trials and rejections, p_1, and |p_1 - stored p_1|. The one-level way: the first 4
prompts of the distillation list x 24 tokens, 16 children (`--depth 2`); the deep way:
`measure_and_cache`'s own settings (`AUTO_PROMPTS`, `AUTO_TRIALS`, `AUTO_REJECTIONS`, the depth
per prompt by `measuring_depth`). Both decode the same prompts in the same order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", default="self-q8,default")
    ap.add_argument("--offload", default="disk")
    ap.add_argument("--seeds", default="0,1", help="seeds of the T=0.6 runs (T=0 runs once)")
    ap.add_argument("--json", default="benchmarks/results_quick_measurement.json")
    args = ap.parse_args(argv)
    from sequoia_trees.sampling import SamplingParams
    from offload_engine import Engine
    from offload_engine.speculation import measure
    from offload_engine.speculation.acceptance_store import stored_vectors
    rows = []
    prompts = measure.read_prompts(measure.DEFAULT_PROMPTS)
    print("| draft | T | seed | way | seconds | steps | rank 1 tried | rejected | p_1 | stored p_1 | error |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for draft in args.drafts.split(","):
        with Engine.load("default", draft=draft, tree="sequoia", offload=args.offload, progress=False) as engine:
            stored = stored_vectors(engine.target_fingerprint, engine.draft_key)
            if not stored:
                print(f"{draft}: no stored vector for this placement's draft key {engine.draft_key}", file=sys.stderr)
                continue
            for t in (0.0, 0.6):
                reference = stored[t][0].probs[0]
                for seed in ([0] if t == 0 else [int(x) for x in args.seeds.split(",")]):
                    for way, kw in (("one-level", dict(depth=2, ps=prompts[:4])),
                                    ("deep", dict(depth=None, trials=measure.AUTO_TRIALS,
                                                  rejections=measure.AUTO_REJECTIONS,
                                                  ps=prompts[:measure.AUTO_PROMPTS]))):
                        ps = kw.pop("ps")
                        t0 = time.perf_counter()
                        got = measure.on_policy(engine, ps, measure.AUTO_WIDTH, SamplingParams(t, 1.0),
                                                measure.AUTO_NEW_TOKENS, 100 * seed, **kw)
                        seconds = time.perf_counter() - t0
                        tried = got.evidence.at_risk[0]
                        row = dict(draft=draft, temperature=t, seed=seed, way=way, seconds=round(seconds, 1),
                                   steps=got.steps, tried=tried, rejected=tried - got.evidence.accepted[0],
                                   p1=got.vector.probs[0], stored_p1=reference, depths=list(got.depths),
                                   error=abs(got.vector.probs[0] - reference))
                        rows.append(row)
                        print(f"| {draft} | {t:g} | {seed} | {way} | {seconds:.1f} | {got.steps} | {tried} | "
                              f"{row['rejected']} | {row['p1']:.3f} | {reference:.3f} | {row['error']:.3f} |", flush=True)
    Path(args.json).write_text(json.dumps({"offload": args.offload, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
