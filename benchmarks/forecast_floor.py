"""How close can an answer's step-by-step forecast be, were the model exactly right? The floor
under issue 19's second bar ("after adaptation, [the prediction is] within 10%").

    python benchmarks/forecast_floor.py --vector hw_profiles/acceptance/smollm2-135m-instruct__self-q8__t0.json \
        --trees "16,13 16,16 8,8" --lengths 39,127 [--answers 5] [--tolerance 0.10] [--observed 1.146]

The planner forecasts each step before it runs: its seconds, and the tokens it is expected to
hand out, E[min(X, left)] for X the step's tokens (`Candidates.emitted`); an answer's forecast
s/token is the sum of the one over the sum of the other, against the seconds and tokens measured
(`GenerationLog`). Here each step's time is exactly as forecast and every step's tokens are drawn
from the tree's own distribution (`step_tokens_distribution` under the vector): the model is
right, and what is left is the answer's draw. An answer of L tokens from a deep tree is a handful
of steps (39 tokens of a (16, 13) tree: 3 to 5), and one step more or fewer moves its s/token by a
fifth or more. Printed per tree and length: the chance that one answer's forecast is within
`--tolerance` of what it measures, the chance that the pooled forecast of `--answers` answers is
(their summed forecast s/token over their summed measured s/token, answers of equal length), and,
with `--observed R`, the chance that the pooled ratio is R or further from 1 on the same side.
Seeded (`--seed`); `--samples` answers per row. Results: docs/choosing-the-tree.md, "How close a
forecast can be".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def forecast_ratios(pmf, length: int, samples: int, rng: np.random.Generator) -> np.ndarray:
    """[samples, 2]: per simulated answer of `length` tokens, (forecast tokens, steps), each step
    drawing X from `pmf` (P(X = k), k = 0..K, P(X = 0) = 0) and forecast to hand out
    E[min(X, left)]. Its forecast s/token over its measured one is length / forecast tokens (the
    steps' time is as forecast); the steps are returned for the pooled ratio, which weighs
    answers by their time (steps)."""
    pmf = np.asarray(pmf, dtype=np.float64)
    if length < 1 or pmf.ndim != 1 or len(pmf) < 2 or pmf[0] != 0.0 or not np.isclose(pmf.sum(), 1.0):
        raise ValueError("a step-token distribution P(X = k), k = 0..K, with P(X = 0) = 0, and a length of 1 or more")
    ks = np.arange(len(pmf))
    emitted = np.array([(pmf * np.minimum(ks, left)).sum() for left in range(length + 1)])  # E[min(X, left)]
    cdf = np.cumsum(pmf)
    left = np.full(samples, length)
    forecast, steps = np.zeros(samples), np.zeros(samples)
    while (running := left > 0).any():
        forecast[running] += emitted[left[running]]
        steps[running] += 1
        x = np.minimum(np.searchsorted(cdf, rng.random(running.sum()), side="right"), len(pmf) - 1)
        left[running] -= np.minimum(x, left[running])
    return np.stack([forecast, steps], axis=1)


def floor(pmf, length: int, answers: int, tolerance: float, samples: int, seed: int,
          observed: float | None = None) -> dict:
    """The row `main` prints for one tree and length (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    sims = forecast_ratios(pmf, length, samples * answers, rng)
    one = length / sims[:, 0]  # one answer: forecast s/token over measured
    # pooled: sum(steps * s) / sum(forecast tokens) over sum(steps * s) / (answers * length)
    f, n = sims[:, 0].reshape(samples, answers), sims[:, 1].reshape(samples, answers)
    pooled = (n.sum(axis=1) / f.sum(axis=1)) / (n.sum(axis=1) / (answers * length))
    out = {"length": length, "answers": answers, "tolerance": tolerance,
           "one_within": float(np.mean(np.abs(one - 1.0) <= tolerance)),
           "pooled_within": float(np.mean(np.abs(pooled - 1.0) <= tolerance)),
           "steps": sorted(set(int(s) for s in np.unique(sims[:, 1]))),
           "one_middle_80": [float(np.quantile(one, 0.1)), float(np.quantile(one, 0.9))]}
    if observed is not None:
        out["observed"] = observed
        out["pooled_as_far"] = float(np.mean(pooled >= observed) if observed >= 1.0 else np.mean(pooled <= observed))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vector", required=True, help="an acceptance vector file (hw_profiles/acceptance/*.json)")
    ap.add_argument("--trees", default="16,13", help="Sequoia trees 'budget,depth ...' (the DP's optimal tree)")
    ap.add_argument("--lengths", default="39,127", help="the answers' step tokens (max_new_tokens less the first)")
    ap.add_argument("--answers", type=int, default=5, help="answers pooled")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--observed", type=float, default=None, help="a pooled forecast/measured ratio seen in a run")
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from offload_engine.errors import UserError
    from offload_engine.speculation.acceptance_store import read_vector
    from sequoia_trees.dp import optimal_tree
    from sequoia_trees.optimizer import step_tokens_distribution
    try:
        vector, _ = read_vector(args.vector)
        trees = [tuple(int(x) for x in t.split(",")) for t in args.trees.split()]
        lengths = [int(x) for x in args.lengths.split(",")]
        if any(len(t) != 2 or min(t) < 2 for t in trees) or min(lengths) < 1 or args.answers < 1:
            raise ValueError
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError:
        print("error: --trees takes 'budget,depth' pairs of 2 or more, --lengths and --answers numbers of 1 or more",
              file=sys.stderr)
        return 2
    print(f"{args.vector}: p_1 = {vector.probs[0]:.4f}; a perfect step model, {args.samples} answers a row\n")
    print(f"| tree | tokens | steps | one answer within {args.tolerance:.0%} | its middle 80% | "
          f"{args.answers} pooled within {args.tolerance:.0%} |" + (" pooled as far as observed |" if args.observed else ""))
    print("|---|---:|---|---:|---|---:|" + ("---:|" if args.observed else ""))
    for budget, depth in trees:
        pmf = step_tokens_distribution(optimal_tree(vector, budget, depth), vector)
        for length in lengths:
            r = floor(pmf, length, args.answers, args.tolerance, args.samples, args.seed, args.observed)
            lo, hi = r["one_middle_80"]
            print(f"| ({budget}, {depth}) | {length} | {r['steps'][0]}-{r['steps'][-1]} | {r['one_within']:.2f} | "
                  f"{lo - 1:+.0%} to {hi - 1:+.0%} | {r['pooled_within']:.2f} |"
                  + (f" {r['pooled_as_far']:.3f} |" if args.observed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
