"""Stream benchmark: how close a disk-streamed target pass gets to the raw read time of its bytes,
and our streamed plain decoding against HF Accelerate's disk offloading of the same model.

    python benchmarks/stream_bench.py [--target default] [--json out.json]
    sequoia-offload bench stream ...

Everything is measured in one run and reported as ratios:
  (a) raw O_DIRECT read time of all the store's layer blocks, back to back;
  (b) steady-state target pass time over a 128-token prefix for widths 1, 16, 64, 128, 256 (every
      layer read from disk with O_DIRECT on every pass): STEADY passes run back to back after one
      unmeasured pass, so the prefetch that crosses pass boundaries is inside the timing, as it
      is when decoding; the same for a "null pass" (the executor streaming every layer with no
      compute); interleaved with (a) so all see the same disk;
  (c) efficiency = floor / pass time, where the floor is the fastest this tier moved one pass's
      bytes anywhere in the run (the best raw read, null pass or pass): it cannot exceed 1 by
      construction, and a pass at 1 ran as fast as anything this machine did with those bytes.
      The bytes per pass are the executor's measured counts, not the plan's;
  (d) per-token greedy decoding time: ours (every layer from disk each pass) vs transformers with
      accelerate.disk_offload, whose offload files are evicted from the page cache
      (posix_fadvise DONTNEED) before every forward, so both read cold from disk on every pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="checkpoint folder or 'default'")
    p.add_argument("--widths", default="1,16,64,128,256", help="new tokens per pass")
    p.add_argument("--prefix", type=int, default=128, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=5, help="measurements per width (medians reported)")
    p.add_argument("--buffers", type=int, default=None, help="default: the engine's (2 on CUDA, 6 on the CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--offload", default="disk", choices=("disk", "ram"),
                   help="tier every target layer streams from (default disk)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens decoded by each system in (d)")
    p.add_argument("--no-peer", action="store_true", help="skip the HF Accelerate comparison")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    p.add_argument("--verify-reads", action="store_true",
                   help="check every disk read of a layer block against its checksum (default: first reads only)")
    p.add_argument("--weights", default=None,
                   help="the stored format (a --weights value; default auto), or a comma list of them to "
                        "compare in one run instead (e.g. f32,bf16,q8_0,auto,q4_0): bytes per pass and pass time "
                        "per format and width, each against the first, measured round-robin")


def raw_read_seconds(store, reader, buf) -> float:
    """Time to read every layer block once with O_DIRECT, back to back, into one aligned buffer."""
    t0 = time.perf_counter()
    for i in range(store.num_layers):
        reader.read(i, buf)
    return time.perf_counter() - t0


def raw_mover(engine, store):
    """A callable timing the floor of one pass's data movement for the engine's tier: O_DIRECT
    reads of every block (disk), or copies of every RAM-tier block into one device buffer (ram)."""
    import torch
    from offload_engine.runtime.layer_store import aligned_buffer
    plan, executor = engine.plan, engine.model.layers
    if plan.disk_layers:
        # one long-lived buffer, like the executor's own: O_DIRECT into a freshly mapped buffer
        # sometimes ran at half speed for its whole life on this project's machines
        buf, reader = aligned_buffer(store.layout.max_block), store.reader(direct=True)
        return lambda: raw_read_seconds(store, reader, buf)
    dest = torch.empty(store.layout.max_block, dtype=torch.uint8, device=engine.model.device)
    blocks = [executor.ram_blocks[i] for i in plan.ram_layers]

    def copy_all() -> float:
        t0 = time.perf_counter()
        for b in blocks:
            dest[:b.numel()].copy_(b, non_blocking=True)
        if dest.is_cuda:
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0
    return copy_all


STEADY = 3  # passes timed back to back after one unmeasured pass


def efficiency_row(width: int, raws: list[float], nulls: list[float], passes: list[float], measured_bytes: float,
                   floor_s: float) -> dict:
    """One width's row: medians, and efficiency = floor / median pass (floor_s is the fastest any
    movement of one pass's bytes took in the whole run, so efficiency <= 1 by construction)."""
    floor_s = min([floor_s] + raws + nulls + passes)
    pass_s = statistics.median(passes)
    return {"width": width, "raw_read_seconds": min(raws), "null_pass_seconds": statistics.median(nulls),
            "pass_seconds": pass_s, "floor_seconds": floor_s, "measured_bytes_per_pass": measured_bytes,
            "efficiency": floor_s / pass_s}


def _steady(run_pass, sync) -> float:
    """Seconds per pass of STEADY passes back to back, after one unmeasured pass."""
    run_pass()
    sync()
    t0 = time.perf_counter()
    for _ in range(STEADY):
        run_pass()
    sync()
    return (time.perf_counter() - t0) / STEADY


def measure_width(engine, raw, width: int, prefix: int, repeats: int) -> dict:
    """Raw reads, steady null passes and steady passes, interleaved (raw, null, pass, raw, ...) so
    that the disk's speed drifting over the run affects all alike; the raw lists for the floor."""
    import torch
    from offload_engine.runtime.model import causal_mask
    model = engine.model
    g = torch.Generator().manual_seed(width)
    vocab = engine.config.vocab_size
    cache = model.new_cache(prefix + width)
    dev = model.device
    model.forward(torch.randint(0, vocab, (prefix,), generator=g).to(dev), torch.arange(prefix, device=dev), cache,
                  logits_rows=slice(prefix - 1, prefix))
    cache.advance(prefix)
    ids = torch.randint(0, vocab, (width,), generator=g).to(dev)
    pos, mask = torch.arange(prefix, prefix + width, device=dev), causal_mask(prefix, width, dev)
    sync = torch.cuda.current_stream().synchronize if model.device.type == "cuda" else (lambda: None)
    def null_pass():
        for _w in model.layers:  # the executor streaming every layer with no compute
            pass

    raws, nulls, passes = [raw()], [], []
    before = model.layers.snapshot()
    for _ in range(repeats):  # raw, null x (1 + STEADY), pass x (1 + STEADY), raw, ...
        nulls.append(_steady(null_pass, sync))
        passes.append(_steady(lambda: model.forward(ids, pos, cache, mask=mask), sync))
        raws.append(raw())
    moved = model.layers.snapshot().minus(before)
    return {"width": width, "raws": raws, "nulls": nulls, "passes": passes,
            "measured_bytes_per_pass": moved.bytes_streamed / moved.target_passes}


def ours_per_token(engine, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    engine.eos_token_ids = frozenset()  # decode exactly `tokens` tokens
    result = engine.generate(input_ids=prompt_ids, max_new_tokens=tokens + 1)
    per_token = (result.stats["seconds"] - result.stats["prefill_seconds"]) / tokens
    return per_token, result.token_ids


def accelerate_per_token(folder: Path, prompt_ids: list[int], tokens: int, tier: str, device,
                         dtype) -> tuple[float, list[int]]:
    """transformers + accelerate: disk_offload with its offload files evicted from the page cache
    before every forward (tier "disk"), or cpu_offload from RAM (tier "ram")."""
    import torch
    import transformers
    from accelerate import cpu_offload, disk_offload
    from offload_engine.formats.gguf_model import SIDECAR_FILE
    if (folder / SIDECAR_FILE).is_file():  # a GGUF model: transformers dequantizes the file itself
        gguf = Path(json.loads((folder / SIDECAR_FILE).read_text())["file"])
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with tempfile.TemporaryDirectory(prefix="accelerate-offload-", dir=os.environ.get("BENCH_TMP")) as off:
        if tier == "disk":
            disk_offload(model, off, execution_device=device)
            files = [os.path.join(off, f) for f in os.listdir(off) if f.endswith(".dat")]

            def evict(*_):
                for f in files:
                    fd = os.open(f, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)

            model.register_forward_pre_hook(evict)
        else:
            cpu_offload(model, execution_device=device)
        ids = torch.tensor([prompt_ids], device=device)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            prefill = time.perf_counter() - t0
            past, tok, new = out.past_key_values, int(out.logits[0, -1].argmax()), []
            for _ in range(tokens):
                new.append(tok)
                out = model(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            total = time.perf_counter() - t0
    return (total - prefill) / tokens, new


def _engine_and_store(args: argparse.Namespace, weights: str = "auto"):
    from offload_engine import Engine
    from offload_engine.formats.checkpoint import open_checkpoint
    from offload_engine.fsutil import cache_root
    from offload_engine.runtime.layer_store import open_or_build
    engine = Engine.load(args.target, device=args.device, offload=args.offload, buffers=args.buffers,
                         max_context=args.prefix + max(int(w) for w in args.widths.split(",")) + 8, weights=weights,
                         verify_reads=args.verify_reads)
    ckpt = open_checkpoint(engine.folder, engine.config)
    try:  # the store the engine built (or, with nothing streamed, one built now)
        store = open_or_build(ckpt, engine.model.dtype, cache_root() / "stores", progress=False, weights=weights,
                              device=engine.model.device if engine.model.device.type == "cuda" else None)
    finally:
        ckpt.close()
    return engine, store


def run(args: argparse.Namespace) -> int:
    import torch
    formats = [f.strip() for f in (args.weights or "auto").split(",") if f.strip()]
    if len(formats) > 1:
        return run_weights(args)
    torch.manual_seed(0)
    engine, store = _engine_and_store(args, formats[0])
    plan = engine.plan
    raw = raw_mover(engine, store)
    measured = [measure_width(engine, raw, int(w), args.prefix, args.repeats) for w in args.widths.split(",")]
    floor = min(min(m["raws"] + m["nulls"] + m["passes"]) for m in measured)  # the run's best, all widths
    rows = [efficiency_row(m["width"], m["raws"], m["nulls"], m["passes"], m["measured_bytes_per_pass"], floor)
            for m in measured]
    raw = min(r["raw_read_seconds"] for r in rows)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the city of Paris."}])
    ours_tok, ours_ids = ours_per_token(engine, prompt, args.tokens)
    stats = engine.model.layers.snapshot()
    engine.close()
    peer = None
    if not args.no_peer:
        peer_tok, peer_ids = accelerate_per_token(engine.folder, prompt, min(args.tokens, 8), args.offload,
                                                  engine.model.device, engine.model.dtype)
        peer = {"seconds_per_token": peer_tok, "same_tokens": peer_ids == ours_ids[: len(peer_ids)]}
    result = {"target": str(engine.folder), "layers_streamed": len(plan.streamed_layers),
              "bytes_per_pass": plan.bytes_per_pass, "raw_read_seconds": raw, "floor_seconds": floor,
              "steady_passes": STEADY, "repeats": args.repeats,
              "raw_read_gbps": plan.bytes_per_pass / raw / 1e9, "tier": args.offload, "device": str(engine.model.device),
              "buffers": plan.buffers,
              "prefix": args.prefix, "passes": rows, "ours_seconds_per_token": ours_tok,
              "ours_stall_seconds_total": stats.stall_seconds, "accelerate": peer,
              "machine": _machine()}
    print(_markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def run_weights(args: argparse.Namespace) -> int:
    """Every --weights format of the list loaded at once, measured round-robin (format by format
    within each repeat) so that the machine's drift affects all alike; medians per width."""
    import torch
    torch.manual_seed(0)
    formats = [f.strip() for f in args.weights.split(",") if f.strip()]
    widths = [int(w) for w in args.widths.split(",")]
    loaded = {f: _engine_and_store(args, f) for f in formats}
    movers = {f: raw_mover(e, s) for f, (e, s) in loaded.items()}
    passes = {f: {w: [] for w in widths} for f in formats}
    raws = {f: [] for f in formats}
    before = {f: e.model.layers.snapshot() for f, (e, _) in loaded.items()}
    for _ in range(args.repeats):
        for f in formats:
            for w in widths:
                m = measure_width(loaded[f][0], movers[f], w, args.prefix, 1)
                passes[f][w] += m["passes"]
                raws[f] += m["raws"]
    rows = []
    for f in formats:
        engine = loaded[f][0]
        moved = engine.model.layers.snapshot().minus(before[f])
        n = max(1, moved.target_passes)
        rows.append({"weights": f, "stored": engine.plan.weights, "bytes_per_pass": engine.plan.bytes_per_pass,
                     "measured_bytes_per_pass": moved.bytes_streamed / n,
                     "raw_read_seconds": min(raws[f]),
                     "pass_seconds": {w: statistics.median(passes[f][w]) for w in widths},
                     "dequant_seconds_per_pass": moved.dequant_seconds / n,
                     "stall_seconds_per_pass": moved.stall_seconds / n})
        engine.close()
    result = {"target": str(loaded[formats[0]][0].folder), "tier": args.offload, "device": args.device,
              "buffers": loaded[formats[0]][0].plan.buffers, "prefix": args.prefix, "repeats": args.repeats,
              "steady_passes": STEADY, "widths": widths, "formats": rows, "machine": _machine()}
    print(_weights_markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _weights_markdown(r: dict) -> str:
    base = r["formats"][0]
    lines = [f"target: {r['target']} on {r['device']}; every layer streamed from {r['tier']} each pass; "
             f"{r['buffers']} buffers; prefix {r['prefix']} tokens; medians of {r['repeats']} x {r['steady_passes']} "
             f"steady passes, formats measured round-robin", "",
             "| --weights | stored | MB per pass | vs first | best raw read (s) | "
             + " | ".join(f"pass w={w} (s) | vs first" for w in r["widths"]) + " | dequant per pass (s) | "
             "stall per pass (s) |",
             "|---|---|---:|---:|---:|" + "---:|---:|" * len(r["widths"]) + "---:|---:|"]
    for f in r["formats"]:
        cells = " | ".join(f"{f['pass_seconds'][w]:.3f} | {f['pass_seconds'][w] / base['pass_seconds'][w]:.2f}x"
                           for w in r["widths"])
        lines.append(f"| {f['weights']} | {f['stored']} | {f['bytes_per_pass'] / 1e6:.1f} | "
                     f"{f['bytes_per_pass'] / base['bytes_per_pass']:.3f}x | {f['raw_read_seconds']:.3f} | {cells} | "
                     f"{f['dequant_seconds_per_pass']:.3f} | {f['stall_seconds_per_pass']:.3f} |")
    return "\n".join(lines)


def _machine() -> dict:
    import platform

    import psutil
    import torch
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


def _markdown(r: dict) -> str:
    lines = [f"target: {r['target']} on {r['device']}", f"{r['layers_streamed']} layers streamed from {r['tier']} per pass, "
             f"{r['bytes_per_pass'] / 1e6:.0f} MB planned; best raw read/copy {r['raw_read_seconds']:.3f} s "
             f"({r['raw_read_gbps']:.2f} GB/s); floor (fastest movement of one pass's bytes in the run) "
             f"{r['floor_seconds']:.3f} s; {r['buffers']} buffers; prefix {r['prefix']} tokens; passes timed "
             f"{r['steady_passes']} back to back, medians of {r['repeats']}", "",
             "| width | best raw read (s) | null pass, steady (s) | pass, steady (s) | MB moved per pass (measured) "
             "| efficiency = floor / pass |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in r["passes"]:
        lines.append(f"| {row['width']} | {row['raw_read_seconds']:.3f} | {row['null_pass_seconds']:.3f} | "
                     f"{row['pass_seconds']:.3f} | {row['measured_bytes_per_pass'] / 1e6:.1f} | {row['efficiency']:.3f} |")
    cold = "read cold from disk (O_DIRECT; page cache evicted for Accelerate)" if r["tier"] == "disk" else "from RAM"
    lines += ["", f"| decoding, every layer {cold} each pass | s/token | vs ours |", "|---|---:|---:|",
              f"| sequoia-offload plain streamed | {r['ours_seconds_per_token']:.3f} | 1.00x |"]
    if r["accelerate"]:
        a = r["accelerate"]
        peer = "disk_offload" if r["tier"] == "disk" else "cpu_offload"
        lines.append(f"| transformers + accelerate.{peer} | "
                     f"{a['seconds_per_token']:.3f} | {a['seconds_per_token'] / r['ours_seconds_per_token']:.2f}x "
                     f"slower |")
        lines.append(f"\nsame greedy tokens as ours: {a['same_tokens']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
