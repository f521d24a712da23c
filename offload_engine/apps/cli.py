"""The command line: parse arguments, build the engine, call one library function.

User mistakes print one line `sequoia-offload: error: ...` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ..errors import UserError

DEMO_PROMPT = "What is the capital of France, and what is it famous for?"
DEMO_TOKENS = 128  # the demo's max_new_tokens (its tree and draft are chosen for answers this long)
DEMO_PLAIN_STEPS = 8  # plain steps timed after the demo's answer: the yardstick of its speed-up


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", default="default",
                   help="checkpoint folder (Hugging Face layout), a llama GGUF file (or a folder holding one), "
                        "a Hugging Face id in the local cache (org/name[@revision]), ollama:NAME[:TAG], "
                        "or 'default' (embedded SmolLM2-135M-Instruct, its Q4_1 GGUF); `models` lists them")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", default=None, help="compute dtype: bfloat16, float16, float32 "
                                                 "(default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--max-context", type=int, default=None, help="longest sequence in tokens (default: "
                                                                "the model's limit, at most 8192)")
    o = p.add_argument_group("placement (where the target's layers live)")
    o.add_argument("--offload", default="auto", choices=("auto", "none", "ram", "disk"),
                   help="auto: follow the plan from the budgets; none: every layer resident on the device; "
                        "ram: every layer streamed from (pinned) RAM; disk: every layer streamed from disk "
                        "with O_DIRECT on every pass")
    o.add_argument("--vram", default=None, help="device memory budget, e.g. 20GiB (default: free memory minus "
                                                "1 GiB; on the CPU, free RAM minus 4 GiB)")
    o.add_argument("--ram", default=None, help="RAM budget for streamed layers, e.g. 64GiB (default: free RAM "
                                               "minus 4 GiB on a GPU machine; 0 on the CPU)")
    t = p.add_argument_group("speculation (with a draft)")
    t.add_argument("--draft", default=None,
                   help="draft kept resident: 'auto' (the default for demo, generate, chat and serve: the one "
                        "the optimizer predicts fastest on this machine, from each candidate's measured profile "
                        "and acceptance; `plan --draft auto` shows the table; 'none': no draft), "
                        "a checkpoint folder, .gguf file, Hugging Face id or ollama:NAME "
                        "(same tokenizer); 'default' (the embedded "
                        "target's distilled draft); 'self-int8' or 'self-int4' (the target's own layers "
                        "quantised, sharing its embeddings and head); 'self-q8' or 'self-q4' (substitute "
                        "self-drafts: the target's own resident layers, a quantised copy only of each streamed "
                        "layer, and the target's KV cache shared); 'suffix' (no model: continuations of text "
                        "already seen); or any of the model drafts followed by '+suffix' (both, grafted)")
    t.add_argument("--draft-candidates", default=None, metavar="A,B",
                   help="--draft auto: more drafts to consider (folders, .gguf files, model names), beside the "
                        "self-drafts, the default draft (embedded target) and same-tokenizer models found beside "
                        "the target")
    t.add_argument("--suffix-memory", type=int, default=1_000_000,
                   help="--draft ...suffix: tokens of earlier prompts and outputs kept to draft from (default "
                        "1,000,000, 4 bytes each; the oldest are forgotten)")
    t.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                   help="grow the next step's tree while the target's pass waits for streamed layers (static "
                        "trees; default auto: for the substitute self-drafts self-q8 / self-q4, while what the "
                        "next steps used of it is worth what it delayed the passes by; on: every step)")
    t.add_argument("--draft-group-size", type=int, default=64,
                   help="self-int4 / self-q4: inputs per quantisation group (default 64)")
    t.add_argument("--tree", default="auto", choices=("auto", "sequoia", "specexec", "specinfer", "chain", "none"),
                   help="tree kind (default auto: Sequoia's optimal tree, its size and depth chosen from this "
                        "machine's measured profile and the pair's acceptance vector, both measured once and "
                        "cached; sequoia: the optimal tree of --tree-budget nodes)")
    t.add_argument("--tree-budget", type=int, default=None,
                   help="tree nodes, the root included (default 64; with --tree auto the largest considered, "
                        "default 1024)")
    t.add_argument("--tree-depth", type=int, default=None,
                   help="tree levels, the root included (default 8; with --tree auto the most considered, "
                        "default 24)")
    t.add_argument("--no-adapt", dest="adapt", action="store_false",
                   help="--tree auto: keep the tree chosen from the profile for the whole generation (default: "
                        "re-choose it every few steps from what the steps measure); --draft suffix alone: run "
                        "every proposal whole (default: skip or trim those the measured pass cost says do not pay)")
    t.add_argument("--specinfer-width", type=int, default=4, help="SpecInfer: independent sequences (default 4)")
    t.add_argument("--acceptance", default=None,
                   help="acceptance vector JSON (from the acceptance command) shaping --tree sequoia")
    o.add_argument("--weights", default="auto", choices=("auto", "bf16", "f16", "f32", "q8_0", "q4_0", "q4_1"),
                   help="format streamed layers are stored and moved in: auto keeps the checkpoint's own (a "
                        "GGUF's blocks as they are); the others convert when the layer store is built (q8_0, "
                        "q4_0, q4_1 with the gguf package's quantizers: a requantized, different model)")
    o.add_argument("--buffers", type=int, default=None,
                   help="layer buffers streamed layers rotate through (default: 2 on CUDA, 6 on the CPU)")
    o.add_argument("--verify-reads", action="store_true",
                   help="check every disk read of a layer block against its checksum (default: each block's "
                        "first read only; see docs/streaming.md for the cost)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _forget_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--forget", action="store_true",
                   help="--tree auto: plan from the stored acceptance vectors alone, and keep nothing of what "
                        "this run learns (default: what earlier runs' planners learned about this pair's "
                        "acceptance and your answers' lengths is used and kept up to date; "
                        "docs/choosing-the-tree.md#kept-from-one-run-to-the-next)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sequoia-offload", description=(
        "Run a Llama-family model exactly on one GPU (or the CPU). With no command: a one-turn chat "
        "demo with the embedded default model."))
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="one streamed chat turn with the embedded default pair: the target "
                                       "streamed from disk (on a machine without a GPU), the default draft, --tree auto")
    _model_args(demo)
    demo.add_argument("--forget", action="store_true",
                      help="(accepted for older command lines: the demo always plans from the stored acceptance "
                           "vectors and keeps nothing it learns; docs/choosing-the-tree.md#kept-from-one-run-to-the-next)")
    demo.set_defaults(draft="auto", offload=None)
    gen = sub.add_parser("generate", help="generate from a prompt")
    _model_args(gen)
    _forget_arg(gen)
    gen.set_defaults(draft="auto")
    _sampling_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--json", action="store_true",
                     help='print one JSON object {"text", "token_ids", "stats"} on stdout and nothing else')
    chat = sub.add_parser("chat", help="interactive multi-turn chat with streamed answers")
    _model_args(chat)
    _forget_arg(chat)
    chat.set_defaults(draft="auto")
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                       "/v1/models, /health) for desktop assistants and the openai client")
    _model_args(srv)
    _forget_arg(srv)
    srv.set_defaults(draft="auto")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    srv.add_argument("--api-key", action="append", default=None,
                     help="require 'Authorization: Bearer KEY'; repeatable, one key per client (default: the "
                     "SEQUOIA_OFFLOAD_API_KEY environment variable, else no key)")
    srv.add_argument("--suffix-shared", action="store_true",
                     help="--draft ...suffix: let every client draft from every client's earlier text (default: "
                     "one store per API key, or per conversation without keys, since latency would reveal a match)")
    srv.add_argument("--max-queue", type=int, default=16, help="requests that may wait while one generates; "
                     "more get HTTP 429 (default 16)")
    srv.add_argument("--insecure-no-key", action="store_true", help="serve a --host other than this machine "
                     "without --api-key (refused otherwise: anyone who can reach it could use the model)")
    srv.add_argument("--max-body", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                     help="largest request body; larger ones get HTTP 413 unread (default 4194304, 4 MiB)")
    srv.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                     help="seconds a client has to send a request's headers, then its body; slower ones are "
                     "dropped (a late body gets HTTP 408; default 30)")
    srv.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                     help="let browser pages from ORIGIN (e.g. http://localhost:3000) call the API; repeatable "
                     "(default: none)")
    srv.add_argument("--cache-slots", type=int, default=1, help="conversations whose KV caches are kept for prefix "
                     "reuse, each reserved in the plan (default 1; 2 keeps a desktop assistant's side requests, "
                     "such as titles, from evicting the conversation)")
    srv.add_argument("--model-name", default=None, help="the model id clients send (default: the checkpoint "
                     "folder's name; SmolLM2-135M-Instruct for the embedded default)")
    conv = sub.add_parser("convert-gguf", help="convert a llama-architecture GGUF file to a Hugging Face folder")
    conv.add_argument("gguf_file", type=Path)
    conv.add_argument("out_dir", type=Path)
    conv.add_argument("--dtype", default="float32", help="dtype of the written weights (default float32)")
    sub.add_parser("default-model", help="print the embedded default model's folder (its configuration and "
                                         "tokenizer, read from its GGUF file first if needed)")
    acc = sub.add_parser("acceptance", help="measure the acceptance vector of a (target, draft) pair")
    _model_args(acc)
    acc.add_argument("--prompts", required=True, help="one prompt per line, or JSONL chat messages")
    acc.add_argument("--out", required=True, help="JSON file to write")
    acc.add_argument("--width", type=int, default=32, help="on-policy: children of the measuring tree's root "
                     "(and the vector's width; default 32)")
    acc.add_argument("--depth", type=int, default=None,
                     help="on-policy: levels of the measuring tree, its root's included (default 8: below the "
                          "root's children, each first child has 4 children more, so a step's accepted path "
                          "measures the first ranks several times over; 2: a one-level tree)")
    acc.add_argument("--mode", default="on-policy", choices=("on-policy", "teacher-forced"))
    acc.add_argument("--temperature", type=float, default=0.0)
    acc.add_argument("--top-p", type=float, default=1.0)
    acc.add_argument("--max-new-tokens", type=int, default=64, help="on-policy: tokens decoded per prompt")
    acc.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    acc.add_argument("--seed", type=int, default=0)
    dist = sub.add_parser("distill", help="distil a small draft for a target from the target's own answers")
    dist.add_argument("--target", default="default", help="checkpoint folder or 'default'")
    dist.add_argument("--out", required=True, type=Path, help="folder to write (Hugging Face layout)")
    dist.add_argument("--layers", type=int, default=3, help="decoder layers of the draft (default 3)")
    dist.add_argument("--hidden", type=int, default=None,
                      help="hidden size (default: the target's; then the draft starts from the target's weights)")
    dist.add_argument("--tokens", type=int, default=200_000, help="training positions in all (default 200000)")
    dist.add_argument("--gen-tokens", type=int, default=None,
                      help="tokens of target answers to generate (default: half of --tokens)")
    dist.add_argument("--prompts", default=None, help="prompt list (default: the shipped distill_prompts.jsonl)")
    dist.add_argument("--data", default=None, help="extra plain-text file to train on as well")
    dist.add_argument("--init-layers", default=None, help="target layers to copy, e.g. 0,1,2 (default: the first ones)")
    dist.add_argument("--lr", type=float, default=3e-4)
    dist.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    dist.add_argument("--seed", type=int, default=0)
    dist.add_argument("--device", default="cpu", help="cpu or cuda")
    dist.add_argument("--offload", default="auto", choices=("auto", "none", "ram", "disk"),
                      help="where the target's layers live while it teaches (as for generate): a target "
                           "larger than the device streams, one pass per batch")
    dist.add_argument("--vram", default=None, help="device memory budget for the target")
    dist.add_argument("--ram", default=None, help="RAM budget for the target's streamed layers")
    dist.add_argument("--resume", action="store_true", help="continue the interrupted run in <out>.partial")
    prof = sub.add_parser("profile", help="measure this machine for --tree auto: streaming bandwidth, the "
                                          "target's pass time t(n) and the draft's level time (cached)")
    _model_args(prof)
    prof.add_argument("--out", default=None, help="also write the profile JSON here")
    prof.add_argument("--budget-s", type=float, default=120.0,
                      help="time budget: wider target passes are skipped once it is spent (default 120)")
    prof.add_argument("--force", action="store_true", help="measure again even when a cached profile exists")
    sim = sub.add_parser("simulate", help="predict speed on a GPU you may not have: placement, chosen tree, "
                                         "tokens/step, s/token, speed-up over plain offloaded decoding")
    sim.add_argument("--gpu", default=None, help="spec-sheet profile: rtx4090, rtx3090, rtx4080, l40, a100-40gb, "
                                                 "h100-pcie, or a JSON file of the same form")
    sim.add_argument("--profile", default=None, help="a measured profile (profile --out FILE) instead of --gpu: "
                                                     "this machine's own timings")
    sim.add_argument("--ram", default="64GiB", help="host RAM (default 64GiB; 8 GiB of it kept for the OS)")
    sim.add_argument("--vram", default=None, help="device budget (default: the GPU's memory minus 1 GiB)")
    sim.add_argument("--model", default="llama-2-70b", help="target shape preset (default llama-2-70b)")
    sim.add_argument("--draft", default="llama-2-7b", help="draft shape preset, 'self-q4' / 'self-q8' (substitute "
                                                   "self-drafts), or 'none' (default llama-2-7b)")
    sim.add_argument("--precision", default="fp16", choices=("fp16", "int8", "int4", "q8_0", "q4_0", "q4_1", "q5_0",
                                                              "q5_1", "q4_k", "q5_k", "q6_k"),
                     help="the target's weights as streamed (default fp16); q* are the GGUF block formats "
                          "the runtime streams as they are, at their real bits per weight, dequantized on the GPU")
    sim.add_argument("--draft-precision", default="fp16", choices=("fp16", "int8", "int4", "q8_0", "q4_0", "q4_1",
                                                                    "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"),
                     help="the draft's weights, resident (default fp16; q*: a GGUF draft kept in its blocks)")
    sim.add_argument("--offload", default="auto", choices=("auto", "ram", "disk"),
                     help="auto: as many layers resident as fit, the rest streamed; ram: every layer streamed")
    sim.add_argument("--acceptance", default=None, help="acceptance vector JSON (default: the Sequoia paper's "
                                                        "Llama3-70B/8B example vector, hw_profiles/published/)")
    sim.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                     help="model the draft growing the next tree while the pass waits for streamed layers "
                          "(default auto: on for self-q4 / self-q8, as the engine runs them)")
    sim.add_argument("--tree", default=None, help="evaluate this tree N,D (nodes, levels) instead of choosing one")
    sim.add_argument("--tokens-per-step", type=float, default=None,
                     help="with --tree: the tokens per step to assume (e.g. a published figure)")
    sim.add_argument("--max-budget", type=int, default=1024)
    sim.add_argument("--max-depth", type=int, default=24)
    sim.add_argument("--mfu", type=float, default=0.5, help="matmul efficiency assumed (default 0.5)")
    sim.add_argument("--layer-overhead-ms", type=float, default=0.1, help="launch overhead per layer (default 0.1)")
    sim.add_argument("--nvme-gbps", type=float, default=6.0, help="disk tier read GB/s (default 6)")
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    mdl = sub.add_parser("models", help="every model on this machine (Hugging Face cache, Ollama, the default, "
                                        "--search folders): size, format, where its layers would live, "
                                        "predicted speed, which pairs can speculate together")
    mdl.add_argument("--search", action="append", default=[], metavar="DIR",
                     help="also look for checkpoint folders and .gguf files here (three levels down; repeatable)")
    mdl.add_argument("--gpu", default=None, help="predict on this spec-sheet GPU (default: this machine's GPU when "
                                                 "its sheet is shipped: rtx4090, rtx3090, rtx4080, l40, a100-40gb, "
                                                 "h100-pcie)")
    mdl.add_argument("--ram", default=None, help="host RAM for the prediction (default: this machine's)")
    mdl.add_argument("--vram", default=None, help="device budget for the prediction (default: the GPU's memory "
                                                  "minus 1 GiB)")
    mdl.add_argument("--json", action="store_true", help="print the table as JSON")
    plan = sub.add_parser("plan", help="print where every part of the target would live, without loading it")
    _model_args(plan)
    plan.add_argument("--cache-slots", type=int, default=1, help="KV caches kept for prefix reuse (serve)")
    plan.add_argument("--force", action="store_true", help="--draft auto: evaluate the candidates again even "
                                                           "when their table is cached")
    plan.add_argument("--max-new-tokens", type=int, default=None,
                      help="--draft auto: predict for answers of this many tokens (default: long ones)")
    bench = sub.add_parser("bench", help="benchmarks (see benchmarks/)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    stream = bench_sub.add_parser("stream", help="disk-streamed pass time vs raw read time, and vs HF Accelerate")
    from benchmarks import latency, stream_bench
    stream_bench.add_args(stream)
    lat = bench_sub.add_parser("latency", help="every decoding mode and a peer side by side: tokens/step, "
                                               "s/token, speed-up, exactness (benchmarks/latency.py)")
    latency.add_args(lat)
    return parser


def _sampling(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop)


def _candidates(args: argparse.Namespace) -> list[str] | None:
    given = getattr(args, "draft_candidates", None)
    return [x.strip() for x in given.split(",") if x.strip()] if given else None


def _load(args: argparse.Namespace, quiet: bool = False, temperature: float | None = None,
          tokens: int | None = None, remember: bool = False):
    """The engine the flags describe; `temperature` and `tokens`: the requests' temperature and
    max_new_tokens, when known (--draft auto and --tree auto choose for them)."""
    from ..engine import Engine
    if tokens is not None and tokens < 1:  # (before loading anything)
        raise UserError(f"max_new_tokens must be >= 1, got {tokens} (--max-new-tokens)")
    if str(args.draft) == "none":
        args.draft = None
    return Engine.load(args.target, device=args.device, dtype=args.dtype, max_context=args.max_context,
                       offload=args.offload, vram=args.vram, ram=args.ram, buffers=args.buffers,
                       draft=args.draft, tree=args.tree, tree_budget=args.tree_budget, tree_depth=args.tree_depth,
                       specinfer_width=args.specinfer_width, acceptance=_acceptance(args.acceptance),
                       draft_group_size=args.draft_group_size, cache_slots=getattr(args, "cache_slots", 1),
                       weights=args.weights, adapt=getattr(args, "adapt", True),
                       suffix_memory=getattr(args, "suffix_memory", 1_000_000),
                       verify_reads=getattr(args, "verify_reads", False), overlap=getattr(args, "overlap", "auto"),
                       progress=not quiet, draft_candidates=_candidates(args),
                       draft_temperature=temperature, plan_tokens=tokens, remember=remember)


def _acceptance(path: str | None):
    if path is None:
        return None
    from ..speculation.acceptance_store import read_vector
    return read_vector(path)[0]


def _printer(token_id: int, text: str) -> None:
    if text:
        print(text, end="", flush=True)


def _stats_line(stats: dict, yardstick: tuple[float, str] | None = None) -> str:
    """The one-line summary of a generation; `yardstick` (plain decoding's s/token, how it was
    measured) replaces the plain steps the run itself measured in the speed-up it prints."""
    cached = stats["cached_prompt_tokens"]
    reused = f" ({cached} of them cached from the previous turn)" if cached else ""
    line = (f"[{stats['new_tokens']} tokens in {stats['seconds']:.2f} s: {stats['tokens_per_second']:.1f} tokens/s; "
            f"prompt {stats['prompt_tokens']} tokens{reused}, prefill {stats['prefill_seconds']:.2f} s; "
            f"{stats['target_passes']} target passes")
    auto = stats.get("auto")
    if auto is None:
        line += (", 1 token/step (plain decoding)" if stats["tree"] == "none"
                 else f", {stats['tokens_per_step']:.2f} tokens/step (suffix trees)" if stats["tree"] == "suffix"
                 else f", {stats['tokens_per_step']:.2f} tokens/step ({stats['tree']} tree, {stats['tree_budget']} nodes)")
    elif stats["target_steps"]:
        line += f", {stats['tokens_per_step']:.2f} tokens/step, " + _auto_summary(stats, auto, yardstick)
    sfx = stats.get("suffix")
    if sfx:
        line += (f"; suffix drafts: {sfx['accepted_tokens']} tokens accepted, matched {sfx['matched_steps']} of "
                 f"{sfx['lookups']} steps ({sfx['store_matched_steps']} from earlier requests)")
        if sfx.get("gate_runs") is not None:  # --draft suffix alone, --tree auto
            line += f", ran {sfx['gate_runs']} (skipped {sfx['gate_skips']} that would not pay)"
    if stats["bytes_streamed"]:
        line += (f", {stats['bytes_streamed'] / 1e9:.2f} GB streamed at {stats['effective_gbps']:.2f} GB/s, "
                 f"stalled {stats['stall_seconds']:.2f} s")
    return line + f"; finish: {stats['finish_reason']}]"


def _auto_summary(stats: dict, auto: dict, yardstick: tuple[float, str] | None = None) -> str:
    """--tree auto: the trees used, measured s/token against the prediction at the start, and the
    speed-up over plain streamed decoding as measured (plain's time as this run's steps measured
    the target) beside the one predicted at the start."""
    from ..planning.auto_tree import SPREAD_SHARE, spread_text
    decode_s = 1 / stats["decode_tokens_per_second"] if stats["decode_tokens_per_second"] else float("nan")
    start = "plain" if auto["budget"] == 1 else f"({auto['budget']},{auto['depth']})"
    text = (f"trees {auto['trees']}{' (adapting)' if auto['adapt'] else ' (--no-adapt)'}; {decode_s:.3f} s/token "
            f"measured, {auto['predicted_seconds_per_token']:.3f} predicted at the start for {start}")
    # (an answer that ended sooner than planned: the start's prediction for its own length too,
    # since a short answer's last step throws away more of what it accepted)
    made = auto.get("predicted_for_made")
    if made:
        text += f" ({made['seconds_per_token']:.3f} for an answer of {made['tokens']} tokens)"
    if auto["adapt"] and auto["forecast_seconds_per_token"]:
        text += f", {auto['forecast_seconds_per_token']:.3f} forecast step by step"
    k = auto.get("plain_steps", 0)
    # (how many plain steps the measured speed-up stands on: one step on a disk whose speed moves
    # 2x within a minute is a noisy yardstick, and the line says so)
    plain, how = auto["measured_plain_seconds_per_token"], (f"median of {k} plain steps measured here" if k > 1
                                                             else "1 plain step measured here")
    if yardstick is not None:
        plain, how = yardstick
    elif plain is None:
        plain, how = auto["adapted_plain_seconds_per_token"], "predicted from this run's steps"
    text += (f"; {plain / decode_s:.2f}x over plain streamed decoding ({plain:.3f} s/token, {how}; "
             f"{auto['predicted_speedup']:.2f}x predicted at the start"
             f"{spread_text(auto.get('predicted_speedup_range'), auto.get('predicted_for_tokens'))}")
    if made:
        low_high = made.get("speedup_range")
        text += (f"; for this answer's {made['tokens']} tokens {made['speedup']:.2f}x"
                 + (f", {round(SPREAD_SHARE * 10)} in 10: {low_high[0]:.1f}-{low_high[1]:.1f}x" if low_high else ""))
    return text + ")"


def cmd_demo(args: argparse.Namespace) -> int:
    if args.offload is None:  # the offload regime: PCIe streaming on a GPU, disk streaming without one
        import torch
        gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        args.offload = "auto" if gpu else "disk"
    # (never what generate, chat and serve learned, nor learning from itself: its one canned prompt
    # is no sample of the user's, and planned from what the user's own answers taught, the demo's
    # easy answer measured 2.98-3.54x against 2.05-2.66x predicted, 2026-12-07; written back, its
    # repeats taught the planner that one answer and its trees cycled. The stored vectors, measured
    # on 40 calibration prompts, are the same for every run)
    engine = _load(args, temperature=0.0, tokens=DEMO_TOKENS, remember=False)
    print(_draft_line(engine, 0.0))
    print(_model_line(engine))
    print(f"user: {DEMO_PROMPT}\nassistant: ", end="", flush=True)
    messages = [{"role": "user", "content": DEMO_PROMPT}]
    engine.first_plain_checks = False  # (plain decoding is timed after the answer instead)
    result = engine.generate(messages=messages, max_new_tokens=DEMO_TOKENS, on_token=_printer)
    print()
    yardstick = None
    if result.stats.get("auto") and result.stats["target_steps"]:
        # the speed-up's yardstick: plain streamed decoding of the same conversation, timed now
        # (its prompt's K/V are reused), the median of DEMO_PLAIN_STEPS steps rather than the one
        # or two plain steps a short answer leaves room for
        print(f"(timing {DEMO_PLAIN_STEPS} steps of plain streamed decoding of the same prompt for the comparison)",
              file=sys.stderr, flush=True)
        plain = engine.generate(messages=messages, max_new_tokens=DEMO_PLAIN_STEPS + 1, plain=True)
        times = plain.stats["step_seconds"]
        if times:
            yardstick = (statistics.median(times), f"median of {len(times)} plain steps timed after the answer")
    print(_stats_line(result.stats, yardstick))
    return 0


def _draft_line(engine, temperature: float) -> str:
    """'draft: NAME, tree (n,d), X s/token predicted, Yx over plain streamed decoding' (the
    optimizer's choices for this temperature; with --draft auto, among how many candidates)."""
    if engine.draft_choice is not None:
        return engine.draft_choice.summary(temperature)
    if engine.draft is None:
        return ("draft: suffix (continuations of text already seen; no prediction)" if engine.suffix_store is not None
                else "draft: none (plain streamed decoding)")
    name = engine.draft_name or engine.draft_key or "given"
    if not engine.auto_plans:
        return f"draft: {name}, {engine.tree.kind} tree of {engine.tree.max_nodes} nodes (fixed, no prediction)"
    return f"draft: {name}, {engine.plan_for(temperature).line()}"


def _model_line(engine) -> str:
    """'model: NAME on DEVICE (DTYPE)', and what a target pass streams, in which formats."""
    from ..formats.gguf_model import display_name
    from ..runtime.placement import fmt_bytes
    plan = engine.plan
    line = f"model: {display_name(engine.folder)} on {engine.model.device} ({engine.model.dtype})"
    if plan.streamed_layers:
        line += (f"; {len(plan.streamed_layers)} of {plan.num_layers} layers streamed, "
                 f"{fmt_bytes(plan.bytes_per_pass)} per target pass ({plan.weights})")
    return line


def _messages(prompt: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def cmd_generate(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise UserError("--system needs --chat (a plain prompt has no system message)")
    engine = _load(args, quiet=args.json, temperature=args.temperature, tokens=args.max_new_tokens,
                   remember=not args.forget)
    source = {"messages": _messages(args.prompt, args.system)} if args.chat else {"prompt": args.prompt}
    result = engine.generate(**source, **_sampling(args), on_token=None if args.json else _printer)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats}))
    else:
        print("\n" + _stats_line(result.stats), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _load(args, temperature=args.temperature, tokens=args.max_new_tokens, remember=not args.forget)
    print(_draft_line(engine, args.temperature))
    print(_model_line(engine))
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    last_stats: dict | None = None
    print("chat: type a message; /reset clears the history, /stats shows the last answer's stats, "
          "/exit quits; Ctrl-C stops an answer.")
    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            print("(history cleared)")
            continue
        if line == "/stats":
            print(json.dumps(last_stats, indent=2) if last_stats else "(no answer yet)")
            continue
        history.append({"role": "user", "content": line})
        answer: list[str] = []

        def on_token(token_id: int, text: str) -> None:
            answer.append(text)
            _printer(token_id, text)

        print("assistant> ", end="", flush=True)
        try:
            last_stats = engine.generate(messages=history, **_sampling(args), on_token=on_token, switch=False).stats
            print("\n" + _stats_line(last_stats))
            last_stats["draft_switch"] = engine.after_answer()  # (--draft auto, once the answer is out)
        except KeyboardInterrupt:
            print("\n(stopped)")
        except UserError as e:  # e.g. the conversation outgrew the context: keep the session
            print(f"\nerror: {e}")
            history.pop()
            continue
        history.append({"role": "assistant", "content": "".join(answer)})


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from ..formats.default_model import DEFAULT_MODEL_NAME
    from ..formats.gguf_model import display_name
    from .server import check_bind, check_limits, serve
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    check_limits(args.max_queue, args.max_body, args.body_timeout)
    api_key = args.api_key or os.environ.get("SEQUOIA_OFFLOAD_API_KEY") or None
    if isinstance(api_key, list) and not all(api_key):
        raise UserError("--api-key must not be empty")
    check_bind(args.host, api_key, args.insecure_no_key)  # before the model loads: a refusal comes at once
    engine = _load(args, remember=not args.forget)
    from ..formats.model_names import is_model_name
    name = args.model_name or (DEFAULT_MODEL_NAME if args.target == "default" else
                               args.target if is_model_name(args.target) else display_name(engine.folder))
    try:
        serve(engine, name, args.host, args.port, api_key, args.max_queue, args.cors_origin,
              suffix_shared=args.suffix_shared, max_body_bytes=args.max_body, body_timeout_s=args.body_timeout,
              insecure_no_key=args.insecure_no_key)
    finally:
        engine.close()
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ..formats.config import parse_dtype
    from ..formats.gguf_import import convert_gguf
    out = convert_gguf(args.gguf_file, args.out_dir, dtype=parse_dtype(args.dtype))
    print(out)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from ..engine import plan_only
    from ..runtime.blocks import WEIGHTS_CHOICES
    from ..runtime.placement import fmt_bytes

    def plan_for(weights: str):
        return plan_only(args.target, device=args.device, dtype=args.dtype, max_context=args.max_context,
                         offload=args.offload, vram=args.vram, ram=args.ram, buffers=args.buffers, draft=args.draft,
                         draft_group_size=args.draft_group_size, cache_slots=args.cache_slots, weights=weights)

    if str(args.draft) == "auto":
        return _plan_draft_auto(args)
    if args.max_new_tokens is not None:
        raise UserError("plan --max-new-tokens is for --draft auto (the candidates predicted for answers that long)")
    plan, folder, device, dtype = plan_for(args.weights)
    print(f"target: {folder} on {device} ({dtype}), --offload {args.offload}, --weights {args.weights}\n")
    print(plan.table())
    for weights in WEIGHTS_CHOICES:
        if weights == args.weights:
            continue
        try:
            other = plan_for(weights)[0]
        except UserError:
            continue  # this format does not fit the shapes, or the budgets
        hint = tier_change(plan, other)
        if hint:
            print(f"--weights {weights}: {hint} ({fmt_bytes(other.bytes_per_pass)} per pass)")
    return 0


def _plan_draft_auto(args: argparse.Namespace) -> int:
    """plan --draft auto: every candidate draft, why it was dropped or what it is predicted to
    make (the tree --tree auto would choose and its s/token at T=0 and 0.6), the one chosen."""
    from ..engine import choose_draft
    from ..planning.draft_choice import choice_path
    kwargs = dict(device=args.device, dtype=args.dtype, max_context=args.max_context, offload=args.offload,
                  vram=args.vram, ram=args.ram, buffers=args.buffers, weights=args.weights,
                  draft_group_size=args.draft_group_size, cache_slots=args.cache_slots,
                  tree_budget=args.tree_budget, tree_depth=args.tree_depth,
                  verify_reads=getattr(args, "verify_reads", False), max_batch_tokens=1024,
                  overlap=getattr(args, "overlap", "auto"))  # (the key Engine.load's --draft auto uses)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    choice = choose_draft(args.target, kwargs, None, _candidates(args), True, args.force,
                          length=args.max_new_tokens)
    print(choice.table())
    print(f"\n{choice.summary()}")
    from ..engine import resolve_target
    print(f"(cached in {choice_path(resolve_target(args.target, False), kwargs, _candidates(args))})")
    return 0


def tier_change(plan, other) -> str:
    """What another --weights choice would move up a tier, in words ('' when nothing)."""
    moves = []
    up = len(other.resident_layers) - len(plan.resident_layers)
    if up > 0:
        moves.append(f"{up} more layers resident on the device")
    off_disk = len(plan.disk_layers) - len(other.disk_layers) - max(up, 0)
    if off_disk > 0 and len(other.ram_layers) > len(plan.ram_layers) - max(up, 0):
        moves.append(f"{off_disk} layers from disk to RAM")
    elif len(plan.disk_layers) > len(other.disk_layers) and not other.disk_layers:
        moves.append("no layer read from disk")
    return ", ".join(moves)


def _model_draft(draft, command: str):
    """The model part of a --draft value ("X+suffix": X), for commands that measure a draft model."""
    from ..speculation.suffix import split_draft
    model = split_draft(draft)[0]
    if model is None:
        raise UserError(f"{command} needs a draft model (--draft): it measures the draft's "
                        f"{'level time' if command == 'profile' else 'acceptance'} (a suffix draft has none)")
    return model


def cmd_profile(args: argparse.Namespace) -> int:
    from ..planning import profiler
    args.draft = _model_draft(args.draft, "profile")
    if args.tree == "auto":
        args.tree = "sequoia"  # the profile is what auto needs: load without planning
    engine = _load(args)
    prof, path, fresh = profiler.cached_or_measured(engine, args.budget_s, progress=True, force=args.force)
    print(f"{'measured' if fresh else 'cached'}: {path}")
    if not fresh:  # (what `--tree auto` will do with it at load; the profile itself is shown as cached)
        print(profiler.speed_now(engine, prof).describe("would be rescaled when `--tree auto` loads it"))
    print(f"machine: {prof.machine}; {prof.device} ({prof.dtype}); plan: {prof.plan}")
    print(f"streaming: {prof.stream_source} {prof.stream_gb_per_s:.2f} GB/s")
    print("| target tokens | pass s |\n|---:|---:|")
    for n, t in zip(prof.target_tokens, prof.target_pass_s):
        print(f"| {n} | {t:.4f} |")
    for n, was in zip(prof.target_retimed, prof.target_retimed_from_s):
        print(f"the {n}-token pass's median ({was:.4f} s) was over {1 + profiler.BUMP_TOLERANCE:g}x off the line "
              f"through its neighbours'; timed again back to back with them {profiler.BUMP_ROUNDS} times, it is "
              "taken at their median ratio to that line")
    print("| draft level width | greedy s | sampled s |\n|---:|---:|---:|")
    for w, tg, ts in zip(prof.draft_widths, prof.draft_level_greedy_s, prof.draft_level_s):
        print(f"| {w} | {tg:.4f} | {ts:.4f} |")
    if prof.fit_budgets:
        print("| real step (nodes, levels) | greedy s | sampled s |\n|---|---:|---:|")
        for n, d, tg, ts in zip(prof.fit_budgets, prof.fit_depths, prof.fit_step_greedy_s, prof.fit_step_s):
            print(f"| {'plain' if n == 1 else f'({n}, {d})'} | {tg:.4f} | {ts:.4f} |")
        for name, vec in (("greedy", prof.fit_vector_greedy), ("sampled", prof.fit_vector)):
            shown = ", ".join(f"{p:.3f}" for p in (vec or profiler.PROFILE_VECTOR.probs)[:6])
            whose = "the pair's" if vec else "a generic"
            print(f"the {name} steps' trees shaped by {whose} acceptance vector: "
                  f"[{shown}{', ...' if len(vec) > 6 else ''}]")
    for name, g in (("greedy", True), ("sampled", False)):
        t = prof.timings(greedy=g)
        cv = prof.fit_cv_error_greedy if g else prof.fit_cv_error
        print(f"step model, {name}: t_target(n) + {t.draft_factor:.2f} x draft levels {t.step_seconds:+.4f} s "
              f"{t.node_seconds * 1e3:+.3f} ms/node; plain: t_target(1) {t.plain_seconds:+.4f} s; "
              f"cross-validated error {cv:.1%} (each real step predicted from a fit to the others)")
        if t.idle_seconds:
            print(f"overlap, {name}: a pass waits {t.idle(1):.4f} s (1 token) to {t.idle(t.target_tokens[-1]):.4f} s "
                  f"({t.target_tokens[-1]} tokens) for streamed layers; the next step used {t.overlap_use:.0%} of "
                  "the draft work that fits there (step = max(pass, overlapped) + the draft work left)")
    if prof.check_target_s or prof.check_draft_s:
        print("speed check readings (taken again whenever the profile is used): "
              + ", ".join(f"{what} {v * 1e3:.1f} ms" for what, v in (("a one-token target pass", prof.check_target_s),
                                                                     (f"a {profiler.CHECK_WIDTH}-wide draft level",
                                                                      prof.check_draft_s)) if v))
    print(f"measured in {prof.measure_s:.1f} s")
    if args.out:
        Path(args.out).write_text(prof.to_json())
        print(f"-> {args.out}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..planning import simulator
    from ..planning.hw_profile import load_measured
    from ..runtime.placement import parse_size
    tree = None
    if args.tree:
        try:
            n, d = (int(x) for x in args.tree.split(","))
        except ValueError:
            raise UserError(f"--tree {args.tree!r}: give nodes and levels as N,D, e.g. 768,18") from None
        tree = (n, d)
    elif args.tokens_per_step is not None:
        raise UserError("--tokens-per-step needs --tree N,D (a fixed tree whose tokens per step is known)")
    if (args.gpu is None) == (args.profile is None):
        raise UserError("give one of --gpu (a spec sheet) or --profile (a measured profile)")
    for name in ("mfu", "layer_overhead_ms", "nvme_gbps"):
        if not getattr(args, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.profile:
        sim = simulator.simulate_measured(load_measured(Path(args.profile)), args.acceptance, 0.0, tree,
                                          args.tokens_per_step, args.max_budget, args.max_depth)
    else:
        a = simulator.Assumptions(mfu=args.mfu, layer_overhead_s=args.layer_overhead_ms / 1e3,
                                  nvme_gb_per_s=args.nvme_gbps)
        sim = simulator.simulate(args.gpu, parse_size(args.ram), args.model,
                                 None if args.draft in (None, "none") else args.draft, args.precision,
                                 args.acceptance, args.offload, parse_size(args.vram) if args.vram else None, tree,
                                 args.tokens_per_step, args.max_budget, args.max_depth, a, args.draft_precision,
                                 args.overlap)
    print(json.dumps(sim.as_dict(), indent=2) if args.json else sim.report())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks import latency, stream_bench
    if args.bench == "latency":
        return latency.report(latency.run(args), args)
    return stream_bench.run(args)


def cmd_acceptance(args: argparse.Namespace) -> int:
    from sequoia_trees.sampling import SamplingParams

    from ..speculation import measure
    if args.width < 1:
        raise UserError(f"--width must be >= 1, got {args.width}")
    depth = measure.MEASURE_DEPTH if args.depth is None else args.depth
    if depth < 2:
        raise UserError(f"--depth must be >= 2 (the root and its children), got {depth}")
    prompts = measure.read_prompts(args.prompts)[: args.limit]
    try:
        params = SamplingParams(args.temperature, args.top_p)
    except ValueError as e:
        raise UserError(str(e)) from None
    args.draft = _model_draft(args.draft, "acceptance")
    if args.tree == "auto":
        args.tree = "sequoia"  # the measurement picks its own tree: load without planning
    engine = _load(args)
    evidence = None
    if args.mode == "on-policy":
        vector, count, evidence, _ = measure.on_policy(engine, prompts, args.width, params, args.max_new_tokens,
                                                       args.seed, depth)
    else:
        vector, count = measure.teacher_forced(engine, prompts, args.width, params, args.seed)
    out = measure.vector_record(engine, vector, count, args.mode, args.width, params, len(prompts), args.draft,
                                evidence, depth if evidence is not None else None)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    head = ", ".join(f"{p:.3f}" for p in vector.probs[:8])
    seen = f", rank 1 tried {evidence.at_risk[0]} times" if evidence is not None else ""
    print(f"acceptance ({args.mode}, {count} {'steps' if args.mode == 'on-policy' else 'positions'}{seen}): "
          f"p_1..p_8 = [{head}] (sum {sum(vector.probs[:8]):.3f}; all {len(vector.probs)}: "
          f"{sum(vector.probs):.3f}) -> {args.out}")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from .distill import DistillOptions, distill
    try:
        init = tuple(int(x) for x in args.init_layers.split(",")) if args.init_layers else None
    except ValueError:
        raise UserError(f"--init-layers {args.init_layers!r}: give comma-separated layer numbers") from None
    opts = DistillOptions(layers=args.layers, hidden=args.hidden, tokens=args.tokens, gen_tokens=args.gen_tokens,
                          prompts=args.prompts, data=args.data, init_layers=init, lr=args.lr,
                          batch_size=args.batch_size, seed=args.seed, device=args.device, offload=args.offload,
                          vram=args.vram, ram=args.ram)
    out = distill(args.target, args.out, opts, resume=args.resume)
    report = json.loads((out / "distill.json").read_text())
    agree = report["final_agreement"]
    print(f"{out}: {report['tokens_seen']} training positions in {report['seconds'] / 60:.1f} min; held-out "
          f"top-1 agreement {'-' if agree is None else f'{agree:.3f}'}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    import psutil

    from ..runtime.placement import parse_size
    from . import models
    gpu = args.gpu or models.local_gpu()
    ram = parse_size(args.ram) if args.ram else psutil.virtual_memory().total
    rows, note = models.list_models([Path(d) for d in args.search], gpu, ram,
                                    parse_size(args.vram) if args.vram else None, ram_given=bool(args.ram))
    print(models.as_json(rows, note) if args.json else models.table(rows, note))
    return 0


def cmd_default_model(args: argparse.Namespace) -> int:
    from ..formats.default_model import default_model_dir
    print(default_model_dir(progress=True))
    return 0


COMMANDS = {"demo": cmd_demo, "generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
            "convert-gguf": cmd_convert, "default-model": cmd_default_model, "plan": cmd_plan, "bench": cmd_bench,
            "acceptance": cmd_acceptance, "distill": cmd_distill, "profile": cmd_profile,
            "simulate": cmd_simulate, "models": cmd_models}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo"])
    try:
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"sequoia-offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
