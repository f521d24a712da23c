"""What `acceptance_by_depth.py` and `prompt_spread.py` share: the embedded default target with a
draft and one fixed Sequoia tree, answering prompts one after another (prompt i seeded with i)."""

from __future__ import annotations

import argparse


def add_args(ap: argparse.ArgumentParser, *, prompts: int, max_new_tokens: int, budget: int) -> None:
    """--draft, --temperature, --offload, --prompts, --max-new-tokens, --budget, --depth, --json."""
    ap.add_argument("--draft", default="self-q8")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--offload", default="disk")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--budget", type=int, default=budget)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--json", default=None)


def answers(args: argparse.Namespace, prompts: list[dict]):
    """(i, GenerationResult) for each prompt, from one engine loaded with `args`' draft and tree."""
    from offload_engine import Engine
    with Engine.load("default", draft=args.draft, tree="sequoia", tree_budget=args.budget, tree_depth=args.depth,
                     offload=args.offload, progress=False) as engine:
        for i, item in enumerate(prompts):
            yield i, engine.generate(**item, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     seed=i)
