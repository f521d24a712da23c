"""What prefix reuse saves in a conversation: each turn's prefill time with the previous turn's
KV cache reused, against the same turn prefilled from scratch, measured in one run (the two
interleaved turn by turn), with the same answers (greedy) asserted.

    python benchmarks/prefix_reuse.py [--target default] [--offload disk] [--turns 6]

On a streamed target a prefill costs a pass per `max_batch_tokens` chunk plus compute that grows
with the prompt, so a long conversation re-read from scratch costs more every turn, while a reused
one costs one narrow pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload_engine import Engine  # noqa: E402

QUESTIONS = [
    "Explain how a hash map works, with its time complexity.",
    "How does it handle collisions? Give two strategies in detail.",
    "Write a short Python class implementing one of them.",
    "What happens to performance when the load factor grows?",
    "Compare it with a balanced binary search tree.",
    "Summarise our whole discussion in five bullet points.",
    "Which would you pick for a cache of a million entries, and why?",
    "Thank you. One last question: what is consistent hashing?",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--offload", default="disk", choices=("auto", "none", "ram", "disk"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--max-batch-tokens", type=int, default=256,
                    help="prefill chunk (default 256: long conversations take several passes, as on a GPU "
                         "with a 70B target and a short chunk to bound activation memory)")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    engine = Engine.load(args.target, device=args.device, offload=args.offload,
                         max_batch_tokens=args.max_batch_tokens, progress=False)
    history = [{"role": "system", "content": "You are a helpful, thorough assistant."}]
    rows = []
    print("| turn | prompt tokens | reused | prefill s, reused | prefill s, from scratch | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for turn, question in enumerate(QUESTIONS[:args.turns], 1):
        history.append({"role": "user", "content": question})
        # the reused turn first, on the cache the previous turn left; then the same turn from
        # scratch (which leaves the same tokens cached for the next turn)
        t0 = time.perf_counter()
        reused = engine.generate(messages=history, max_new_tokens=args.max_new_tokens)
        reused_s = time.perf_counter() - t0
        engine.forget_prefix()
        scratch = engine.generate(messages=history, max_new_tokens=args.max_new_tokens)
        if scratch.token_ids != reused.token_ids:
            raise SystemExit(f"turn {turn}: the reused answer differs from the from-scratch answer")
        a, b = reused.stats, scratch.stats
        rows.append({"turn": turn, "prompt_tokens": a["prompt_tokens"], "reused_tokens": a["cached_prompt_tokens"],
                     "prefill_s_reused": a["prefill_seconds"], "prefill_s_scratch": b["prefill_seconds"],
                     "turn_s_reused": reused_s})
        print(f"| {turn} | {a['prompt_tokens']} | {a['cached_prompt_tokens']} | {a['prefill_seconds']:.3f} | "
              f"{b['prefill_seconds']:.3f} | {b['prefill_seconds'] / a['prefill_seconds']:.1f}x |", flush=True)
        history.append({"role": "assistant", "content": reused.text})
    total_a = sum(r["prefill_s_reused"] for r in rows)
    total_b = sum(r["prefill_s_scratch"] for r in rows)
    print(f"\nprefill over {len(rows)} turns: {total_a:.2f} s reused vs {total_b:.2f} s from scratch "
          f"({total_b / total_a:.1f}x); every answer identical")
    if args.out:
        Path(args.out).write_text(json.dumps({"target": args.target, "offload": args.offload,
                                              "max_batch_tokens": args.max_batch_tokens, "turns": rows}, indent=2))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
