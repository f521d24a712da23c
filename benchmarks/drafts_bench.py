"""The drafts of the embedded default target, side by side in one run.

    python benchmarks/drafts_bench.py [--drafts self-int8,self-int4,default] [--budgets 16,64,128]
                                      [--prompts 8] [--max-new-tokens 64] [--json out.json]

For each draft:
  (a) its stored acceptance vector (hw_profiles/acceptance/): p_1 and p_1 + ... + p_8 at T=0, 0.6;
  (b) draft forward time per tree level (level widths 1, 16, 64 over a 128-token context) against
      one disk-streamed target pass (64 tokens over the same context, every layer read with
      O_DIRECT), both timed in this run (medians);
  (c) tokens per step of `--tree sequoia` (shaped by the stored vector nearest the temperature)
      at each budget, at T=0 and T=0.6, over the first `--prompts` prompts of
      benchmarks/prompts.jsonl (chat template). Tokens per step does not depend on where the
      target's layers live, so (c) runs with the target resident.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEPTH_FOR_BUDGET = {16: 8, 64: 12, 128: 16}  # levels allowed (the DP uses fewer when they do not pay)


def _pass_seconds(model, width: int, context: int, repeats: int) -> float:
    import torch
    cache = model.new_cache(context + width)
    ids = torch.randint(3, model.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    model.forward(ids.to(model.device), torch.arange(context, device=model.device), cache)
    cache.advance(context)
    new = torch.randint(3, model.cfg.vocab_size, (width,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(context, context + width, device=model.device)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model.forward(new.to(model.device), pos, cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first is a warm-up


def main(argv: list[str] | None = None) -> int:
    from offload_engine import Engine
    from offload_engine.speculation.acceptance_store import stored_vectors
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafts", default="self-int8,self-int4,default")
    p.add_argument("--budgets", default="16,64,128")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    drafts = args.drafts.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    prompts = [json.loads(line)["messages"] for line in
               (Path(__file__).parent / "prompts.jsonl").read_text().splitlines()[: args.prompts]]

    streamed = Engine.load("default", device="cpu", offload="disk", progress=False)
    target_pass = _pass_seconds(streamed.model, 64, 128, args.repeats)
    streamed.close()
    print(f"one disk-streamed target pass (64 tokens over 128): {target_pass * 1e3:.0f} ms", flush=True)

    results = {"target_pass_seconds": target_pass, "drafts": {}}
    for draft in drafts:
        row: dict = {"acceptance": {}, "level_seconds": {}, "tokens_per_step": {}}
        for budget in budgets:
            engine = Engine.load("default", device="cpu", offload="none", draft=draft, tree="sequoia",
                                 tree_budget=budget, tree_depth=DEPTH_FOR_BUDGET.get(budget, 12), progress=False)
            if not row["acceptance"]:
                for t, (vec, path) in sorted(stored_vectors(engine.target_fingerprint, engine.draft_key).items()):
                    row["acceptance"][str(t)] = {"p1": vec.probs[0], "sum_p1_p8": sum(vec.probs[:8]),
                                                 "file": path.name}
                for width in (1, 16, 64):
                    row["level_seconds"][str(width)] = _pass_seconds(engine.draft, width, 128, args.repeats)
            for temperature in (0.0, 0.6):
                new, steps, source = 0, 0, None
                for i, messages in enumerate(prompts):
                    s = engine.generate(messages=messages, max_new_tokens=args.max_new_tokens,
                                        temperature=temperature, seed=i).stats
                    new += s["new_tokens"] - 1
                    steps += s["target_steps"]
                    source = s["acceptance_source"]
                tps = new / max(steps, 1)
                row["tokens_per_step"][f"{budget}@{temperature}"] = {"tokens_per_step": tps, "steps": steps,
                                                                      "acceptance_source": source}
                print(f"{draft:10s} budget {budget:4d} T={temperature}: {tps:.2f} tokens/step ({steps} steps; "
                      f"tree from {source})", flush=True)
            engine.close()
        results["drafts"][draft] = row

    print("\n| draft | T | p_1 | p_1..p_8 | " + " | ".join(f"tokens/step @{b}" for b in budgets) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(budgets))
    for draft, row in results["drafts"].items():
        for t in ("0.0", "0.6"):
            acc = row["acceptance"].get(t)
            cells = [f"{row['tokens_per_step'][f'{b}@{t}']['tokens_per_step']:.2f}" for b in budgets]
            a = f"{acc['p1']:.3f} | {acc['sum_p1_p8']:.3f}" if acc else "- | -"
            print(f"| {draft} | {t} | {a} | " + " | ".join(cells) + " |")
    print(f"\n| draft | level of 1 | level of 16 | level of 64 | (one streamed target pass: "
          f"{target_pass * 1e3:.0f} ms) |\n|---|---:|---:|---:|---|")
    for draft, row in results["drafts"].items():
        lv = row["level_seconds"]
        print(f"| {draft} | " + " | ".join(f"{lv[w] * 1e3:.1f} ms ({lv[w] / target_pass:.3f}x)" for w in ("1", "16", "64"))
              + " | |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
