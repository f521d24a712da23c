"""The load's step check (`profiler.step_check`) on the demo, with it and without it.

    python benchmarks/step_check_study.py --profiles 2 --runs 5 --arms off,0.75 --out FILE.json

Per profile (`--profiles K`: K fresh ones, each measured first by `sequoia-offload profile --draft
self-q8 --offload disk --force`, replacing the cached one the demo uses; 0: the cached one), runs
the demo (`python run_70b.py`) `--runs` times per arm, the arms interleaved: `off` (no step check)
or a power (the step check with STEP_CHECK_TRUST set to it). Each run's answer steps are traced
(the planner's per-step prediction and measurement), and the line printed per run holds:
  - the check's whole step, measured over predicted (the prediction before the check);
  - the answer's steps of the checked tree (the first left out), their median over the same
    prediction: what the check had to foresee;
  - the speed-up measured against the one predicted for the answer's own length, as the demo's
    stats line prints them, and the tree's and plain decoding's s/token, measured against predicted.
At the end, per arm: runs within 15%, and the mean |log| of the answer's steps against the
prediction the arm made (off: the unchecked one; a power k: the unchecked one times the check's
whole-step ratio ** k). Results on the 2-vCPU machine: docs/choosing-the-tree.md, "The step
check, measured".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = re.compile(r"step check: \d+ real \((\d+), (\d+)\) steps took (\d+) ms \(median; predicted (\d+)\)")


def one(arm: str) -> int:
    """In a child process: the demo with the step check off or at power `arm`, each planner step
    printed as 'STEP (n,d) first=... pred_s=... s=...'."""
    sys.path.insert(0, str(ROOT))
    from offload_engine.apps.cli import main
    from offload_engine.planning import adaptive, profiler
    if arm == "off":
        profiler.step_check = lambda *a, **k: None
    else:
        profiler.STEP_CHECK_TRUST = float(arm)
    record = adaptive.OnlinePlanner.record

    def traced(self, spec, result, times, first_step, arm="model", tokens=None):
        before, chosen = self.log.predicted_seconds, self._next()
        out = record(self, spec, result, times, first_step, arm, tokens)
        if self.adapt:
            print(f"STEP ({chosen.budget},{chosen.depth}) first={first_step} "
                  f"pred_s={self.log.predicted_seconds - before:.4f} s={times.total:.4f}", flush=True)
        return out
    adaptive.OnlinePlanner.record = traced
    return main([])


def parse(text: str, arm: str) -> dict:
    m = CHECK.search(text)
    if m:
        shape, measured, predicted = f"({m.group(1)},{m.group(2)})", int(m.group(3)), int(m.group(4))
    else:
        f = re.search(r"STEP (\(\d+,\d+\)) first=True pred_s=([\d.]+)", text)
        shape, measured, predicted = f.group(1), None, float(f.group(2)) * 1000
    steps = [float(m.group(2)) for m in re.finditer(r"STEP (\(\d+,\d+\)) first=False pred_s=[\d.]+ s=([\d.]+)", text)
             if m.group(1) == shape]  # (the answer's text streams on the same lines)
    last = next(line for line in text.splitlines() if line.startswith("["))
    sp = re.search(r"([\d.]+)x over plain streamed decoding \(([\d.]+) s/token, median.*?for this answer.s \d+ "
                   r"tokens ([\d.]+)x", last)
    tree = re.search(r"; ([\d.]+) s/token measured, [\d.]+ predicted at the start for \S+ \(([\d.]+) for an answer",
                     last)
    plain_predicted = re.search(r"tree auto at T=0 for .*?over plain streamed decoding \(([\d.]+) s/token\)", text)
    return {"arm": arm, "tree": shape, "check_whole": None if measured is None else measured / predicted,
            "answer_steps": statistics.median(steps) * 1000 / predicted if steps else None,
            "answer_step_count": len(steps), "speedup": float(sp.group(1)), "speedup_predicted": float(sp.group(3)),
            "tree_s": float(tree.group(1)), "tree_predicted_s": float(tree.group(2)),
            "plain_s": float(sp.group(2)), "plain_predicted_s": float(plain_predicted.group(1))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", type=int, default=0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--arms", default="off,0.75")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one)
    arms, rows = args.arms.split(","), []
    for p in range(max(1, args.profiles)):
        if args.profiles:
            subprocess.run([sys.executable, "run_70b.py", "profile", "--draft", "self-q8", "--offload", "disk",
                            "--force"], cwd=ROOT, check=True, capture_output=True)
        for i in range(args.runs):
            for arm in arms:
                proc = subprocess.run([sys.executable, __file__, "--one", arm], cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ)
                r = {"profile": p + 1, "run": i + 1, **parse(proc.stdout, arm)}
                rows.append(r)
                f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
                print(f"profile {p + 1} run {i + 1} {arm}: check {r['tree']} {f(r['check_whole'])}, answer's steps "
                      f"{f(r['answer_steps'])} (n={r['answer_step_count']}); speed-up {r['speedup']} against "
                      f"{r['speedup_predicted']} {100 * (r['speedup'] / r['speedup_predicted'] - 1):+.1f}%; tree "
                      f"{r['tree_s']} against {r['tree_predicted_s']}; plain {r['plain_s']} against "
                      f"{r['plain_predicted_s']}", flush=True)
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        within = sum(abs(r["speedup"] / r["speedup_predicted"] - 1) <= 0.15 for r in mine)
        k = 0.0 if arm == "off" else float(arm)
        errors = [abs(math.log(r["answer_steps"] / (r["check_whole"] or 1.0) ** k)) for r in mine
                  if r["answer_steps"]]
        print(f"{arm}: {within} of {len(mine)} within 15%; the answer's steps against the prediction: mean |log| "
              f"{statistics.mean(errors) if errors else float('nan'):.3f} over {len(errors)}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
