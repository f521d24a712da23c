"""Build a target model on the device according to a placement plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..formats.config import ModelConfig
from ..fsutil import cache_root
from .layer_store import StoreLayout, aligned_buffer, dense_layer, open_or_build, packed_layer, store_layout
from .model import Transformer, load_globals
from .placement import PlacementPlan, default_budgets, make_plan, parse_size
from .streamer import LayerExecutor, pinned_block


@dataclass(frozen=True)
class OffloadOptions:
    """Where the target's layers may live (the --offload/--vram/--ram/--buffers flags)."""
    offload: str = "auto"  # auto | none | ram | disk
    vram: int | str | None = None  # device budget; default: free device memory minus a margin
    ram: int | str | None = None  # RAM budget for streamed layers; default: free RAM minus a margin
    buffers: int | None = None  # layer buffers streamed layers rotate through; default_buffers()
    max_batch_tokens: int = 1024  # widest forward pass (prefill chunk, largest tree)
    direct_io: bool = True  # O_DIRECT for the disk tier
    store_root: Path | None = None  # where packed layer stores live (default: the cache folder)
    weights: str = "auto"  # storage format of streamed layers (runtime/blocks.py: --weights)
    cache_slots: int = 1  # KV caches kept for prefix reuse (conversations); each reserved in the plan
    verify_reads: bool = False  # checksum every disk read of a block, not only its first (--verify-reads)


def default_buffers(device: torch.device) -> int:
    """2 on a GPU, where each buffer costs a layer of VRAM. 6 on the CPU, where buffers are plain
    RAM: measured on the embedded default, disk-streamed, 2 buffers left the disk idle ~40 ms per
    pass while the head of a 64-token pass computed (the loader can only run k layers ahead); 6
    kept it busy 98% of the time."""
    return 2 if device.type == "cuda" else 6


def make_placement(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, opts: OffloadOptions,
                   max_context: int, draft_bytes: int = 0, draft_kv_bytes: int = 0,
                   store: StoreLayout | None = None, substitute_bytes: int = 0) -> PlacementPlan:
    default_vram, default_ram = (None, None)
    if opts.vram is None or opts.ram is None:
        default_vram, default_ram = default_budgets(device)
        if device.type != "cuda" and opts.offload == "ram":
            default_ram = default_vram  # on the CPU the RAM tier is asked for explicitly: free RAM
    return make_plan(cfg, dtype, offload=opts.offload,
                     vram_bytes=parse_size(opts.vram) if opts.vram is not None else default_vram,
                     ram_bytes=parse_size(opts.ram) if opts.ram is not None else default_ram,
                     buffers=opts.buffers or default_buffers(device), max_context=max_context, max_batch_tokens=opts.max_batch_tokens,
                     draft_bytes=draft_bytes, cache_slots=opts.cache_slots, draft_kv_bytes=draft_kv_bytes,
                     store=store, substitute_bytes=substitute_bytes)


def _host_block(nbytes: int, device: torch.device) -> torch.Tensor:
    return pinned_block(nbytes, device) if device.type == "cuda" else aligned_buffer(nbytes)


def load_target(ckpt, dtype: torch.dtype, device: torch.device, plan: PlacementPlan,
                opts: OffloadOptions, progress: bool = True, layout: StoreLayout | None = None) -> Transformer:
    """Resident parts onto the device, streamed layers into the RAM tier or the disk store.
    Resident layers are dense (dequantized once) or kept in their stored blocks, as the plan says."""
    cfg = ckpt.config
    layout = layout or store_layout(ckpt, dtype, opts.weights)
    globals_ = load_globals(ckpt, dtype, device)
    bar = tqdm(plan.resident_layers, desc="loading resident layers", unit="layer", leave=False,
               disable=None if progress else True)
    resident = {}
    for i in bar:
        if plan.resident_format == "blocks":
            resident[i] = packed_layer(ckpt, i, layout.layouts[i], device)
        else:
            resident[i] = dense_layer(ckpt, i, layout.layouts[i], device)
    ram_blocks: dict[int, torch.Tensor] = {}
    reader = None
    if plan.streamed_layers:
        store = open_or_build(ckpt, dtype, opts.store_root or cache_root() / "stores", progress, opts.weights, layout,
                              device if device.type == "cuda" else None)
        for i in plan.ram_layers:
            ram_blocks[i] = store.load_block(i, _host_block(layout.sizes[i], device))
        if plan.disk_layers:
            reader = store.reader(direct=opts.direct_io, verify_every=opts.verify_reads)
    executor = LayerExecutor(plan, layout, device, resident, ram_blocks, reader)
    return Transformer(cfg, globals_, executor, dtype, device)
