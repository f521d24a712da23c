"""Where every tensor lives: device-resident, pinned RAM, or disk, planned from exact byte counts.

The plan is made before anything is allocated. Resident on the device, always: embeddings, head,
final norm, the draft (when there is one), the KV cache for `max_context` plus the largest batch
of new tokens, an activation workspace, and the layer buffers that streamed layers pass through.
Then as many target layers as still fit the device budget stay resident; the rest live in RAM up
to the RAM budget; the remainder is read from disk on every pass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..formats.checkpoint import layer_shapes
from ..formats.config import ModelConfig
from .layer_store import LayerLayout, StoreLayout

OFFLOAD_MODES = ("auto", "none", "ram", "disk")
GIB = 2**30
DEVICE_MARGIN_BYTES = 1 * GIB  # left free on the device for the CUDA context, allocator slack
RAM_MARGIN_BYTES = 4 * GIB  # left free in RAM for the OS, Python and the page cache

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """'20GiB', '512MB', '1.5g', 1024 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"cannot read the size {text!r}: use a number with a unit, like 20GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class PlacementPlan:
    num_layers: int
    layer_bytes: int  # the largest packed layer block (4 KiB aligned): what a layer buffer holds
    resident_layers: tuple[int, ...]
    ram_layers: tuple[int, ...]
    disk_layers: tuple[int, ...]
    buffers: int  # device layer buffers (0 when nothing streams)
    fixed_bytes: dict[str, int] = field(default_factory=dict)  # resident non-layer parts by name
    vram_budget_bytes: int = 0
    ram_budget_bytes: int = 0
    layer_sizes: tuple[int, ...] = ()  # each layer's stored block (all layer_bytes when empty)
    resident_format: str = "dense"  # resident layers: "dense" (dequantized once at load) or "blocks"
    dense_layer_bytes: int = 0  # one layer in the compute dtype (layer_bytes when 0)
    weights: str = ""  # the stored formats, for people (StoreLayout.summary)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.layer_sizes or (self.layer_bytes,) * self.num_layers

    def resident_cost(self, layer: int) -> int:
        """Device bytes of a resident layer: its block kept as it is, or its dense weights."""
        if self.resident_format == "blocks":
            return self.sizes[layer]
        return self.dense_layer_bytes or self.layer_bytes

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.ram_layers + self.disk_layers))

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident_cost(i) for i in self.resident_layers)

    @property
    def vram_bytes(self) -> int:
        return sum(self.fixed_bytes.values()) + self.resident_bytes

    @property
    def ram_bytes(self) -> int:
        return sum(self.sizes[i] for i in self.ram_layers)

    @property
    def disk_bytes(self) -> int:
        return sum(self.sizes[i] for i in self.disk_layers)

    @property
    def bytes_per_pass(self) -> int:
        """Bytes copied into the device buffers by one target pass."""
        return sum(self.sizes[i] for i in self.streamed_layers)

    def table(self) -> str:
        rows = [("device (resident)", len(self.resident_layers), self.vram_bytes, self.vram_budget_bytes),
                ("RAM (pinned with CUDA)", len(self.ram_layers), self.ram_bytes, self.ram_budget_bytes),
                ("disk (O_DIRECT)", len(self.disk_layers), self.disk_bytes, None)]
        lines = ["| tier | layers | bytes | budget |", "|---|---:|---:|---:|"]
        for name, n, b, budget in rows:
            lines.append(f"| {name} | {n} | {fmt_bytes(b)} | {fmt_bytes(budget) if budget is not None else '-'} |")
        lines.append("")
        lines.append("| resident part | bytes |")
        lines.append("|---|---:|")
        for name, b in self.fixed_bytes.items():
            lines.append(f"| {name} | {fmt_bytes(b)} |")
        how = " (kept in their blocks, dequantized per use)" if self.resident_format == "blocks" else ""
        lines.append(f"| {len(self.resident_layers)} resident layers{how} | {fmt_bytes(self.resident_bytes)} |")
        lines.append("")
        if self.weights:
            lines.append(f"stored weights: {self.weights}")
        sizes = sorted(set(self.sizes))
        block = fmt_bytes(sizes[0]) if len(sizes) == 1 else f"{fmt_bytes(sizes[0])} to {fmt_bytes(sizes[-1])}"
        lines.append(f"layer block: {block}; {len(self.streamed_layers)} of "
                     f"{self.num_layers} layers streamed per pass = {fmt_bytes(self.bytes_per_pass)} per target pass")
        return "\n".join(lines)


def model_bytes(cfg: ModelConfig, dtype: torch.dtype, layers_bytes: int | None = None) -> int:
    """Bytes of a whole model held resident in `dtype` (e.g. a draft): every tensor, no padding;
    with `layers_bytes`, its decoder layers take that instead (a draft kept in its blocks)."""
    from ..formats.checkpoint import global_shapes
    elt = torch.empty((), dtype=dtype).element_size()
    count = lambda shapes: sum(math.prod(s) for s in shapes.values())  # noqa: E731
    layers = cfg.num_layers * count(layer_shapes(cfg)) * elt if layers_bytes is None else layers_bytes
    return count(global_shapes(cfg)) * elt + layers


def largest_matrix_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One layer's largest matrix in `dtype`: the scratch a matrix kept in blocks is dequantized
    into for each use."""
    return max(math.prod(s) for s in layer_shapes(cfg).values()) * dtype.itemsize


def kv_cache_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of one KV cache of `tokens` slots for every layer of `cfg`."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * torch.empty((), dtype=dtype).element_size()


def fixed_parts(cfg: ModelConfig, dtype: torch.dtype, max_context: int, max_batch_tokens: int,
                draft_bytes: int = 0, cache_slots: int = 1, draft_kv_bytes: int = 0) -> dict[str, int]:
    """Bytes of everything that must be resident on the device besides the decoder layers;
    `cache_slots` KV caches (conversations kept for prefix reuse)."""
    elt = torch.empty((), dtype=dtype).element_size()
    h, v = cfg.hidden_size, cfg.vocab_size
    parts = {"embeddings": v * h * elt}
    if not cfg.tie_word_embeddings:
        parts["lm_head"] = v * h * elt
    parts["final norm"] = h * elt
    kv_tokens = max_context + max_batch_tokens  # committed prefix + scratch slots for the batch
    parts["kv cache" if cache_slots == 1 else f"kv cache ({cache_slots} slots)"] = \
        cache_slots * kv_cache_bytes(cfg, dtype, kv_tokens)
    # activations of the widest batch: residual stream and its temporaries, q/k/v/attention out,
    # the MLP's gate/up/product, and fp32 logits for every row (an estimate, erring high)
    q = cfg.num_heads * cfg.head_dim
    parts["workspace"] = max_batch_tokens * ((4 * h + 3 * q + 3 * cfg.intermediate_size) * elt + v * 4)
    if draft_bytes:
        parts["draft"] = draft_bytes
    if draft_kv_bytes:
        parts["draft kv cache" if cache_slots == 1 else f"draft kv cache ({cache_slots} slots)"] = draft_kv_bytes
    return parts


def make_plan(cfg: ModelConfig, dtype: torch.dtype, *, offload: str = "auto", vram_bytes: int,
              ram_bytes: int, buffers: int = 2, max_context: int, max_batch_tokens: int,
              draft_bytes: int = 0, layer_bytes: int | None = None, cache_slots: int = 1,
              draft_kv_bytes: int = 0, store: StoreLayout | None = None, scratch_bytes: int = 0,
              substitute_bytes: int = 0) -> PlacementPlan:
    """Decide each layer's tier. Refuses, naming the numbers, a plan that cannot fit.
    `store` gives each layer's stored bytes and formats (layer_store.store_layout); without it
    every layer is a dense block in `dtype`, or `layer_bytes` (the simulator's quantised weights,
    then kept in blocks, `scratch_bytes` being one layer's dequantized matrices).

    Resident layers are dequantized once at load ("dense") when the whole model fits the device
    that way; otherwise, when the store holds packed formats, they stay in their blocks and are
    dequantized per use ("blocks"), whenever that keeps more of them resident.

    substitute_bytes: a substitute self-draft's quantised copy of one layer (`--draft self-q4`),
    needed on the device for every streamed layer and for no resident one: the layers kept
    resident are chosen with both counted."""
    if offload not in OFFLOAD_MODES:
        raise UserError(f"--offload {offload!r}: choose one of {', '.join(OFFLOAD_MODES)}")
    if buffers < 1:
        raise UserError(f"--buffers must be at least 1, got {buffers}")
    if cache_slots < 1:
        raise UserError(f"--cache-slots must be at least 1, got {cache_slots}")
    L = cfg.num_layers
    dense: int | None = LayerLayout.for_config(cfg, dtype).block_bytes  # one layer dequantized once
    if store is not None:
        sizes, layer, label = store.sizes, store.max_block, store.summary()
        scratch = store.scratch_bytes()  # what each buffer's conversion writes (all packed slot names)
    else:
        layer = layer_bytes if layer_bytes is not None else dense
        sizes, label, scratch = (layer,) * L, "", scratch_bytes
        dense = None if scratch else layer  # the simulator's quantized layers: only ever in blocks
    fixed = fixed_parts(cfg, dtype, max_context, max_batch_tokens, draft_bytes, cache_slots, draft_kv_bytes)
    need = sum(fixed.values())
    common = dict(layer_sizes=tuple(sizes) if store is not None else (), dense_layer_bytes=dense or layer,
                  weights=label)
    whole = offload in ("none", "auto")
    if whole and dense is not None and need + L * dense <= vram_bytes:
        return PlacementPlan(L, layer, tuple(range(L)), (), (), 0, fixed, vram_bytes, ram_bytes, **common)
    # per-use dequantization of a resident matrix needs its dense copy for the while: the largest
    biggest = largest_matrix_bytes(cfg, dtype) if scratch else 0
    if whole and scratch and need + biggest + sum(sizes) <= vram_bytes:
        fixed["dequant scratch (one matrix)"] = biggest  # every layer resident, in its blocks
        return PlacementPlan(L, layer, tuple(range(L)), (), (), 0, fixed, vram_bytes, ram_bytes,
                             resident_format="blocks", **common)
    if offload == "none":
        total = L * (dense or layer)
        raise UserError(f"--offload none: the whole model needs {fmt_bytes(need + total)} on the device "
                        f"({fmt_bytes(total)} of layers + {_parts(fixed)}), more than --vram "
                        f"{fmt_bytes(vram_bytes)}")
    fixed["layer buffers"] = buffers * layer
    need += buffers * layer
    if scratch:
        fixed["dequant scratch"] = buffers * scratch
        need += buffers * scratch
    sub = substitute_bytes
    if need + L * sub > vram_bytes:
        subs = {"draft substitutes (every layer)": L * sub} if sub else {}
        raise UserError(f"--vram {fmt_bytes(vram_bytes)} is too small for the resident parts: "
                        f"{_parts({**fixed, **subs})} = {fmt_bytes(need + L * sub)}")
    fmt, n_res = "dense", 0
    if offload == "auto" and dense is not None:  # each resident layer costs its bytes, saves a substitute
        n_res = min(L - 1, (vram_bytes - need - L * sub) // (dense - sub)) if dense > sub else L - 1
    if offload == "auto" and scratch and need + biggest + L * sub <= vram_bytes:
        room, n_blocks = vram_bytes - need - biggest, 0
        while n_blocks < L - 1 and sum(sizes[:n_blocks + 1]) + (L - n_blocks - 1) * sub <= room:
            n_blocks += 1
        if n_blocks > n_res:
            n_res, fmt = n_blocks, "blocks"
            fixed["dequant scratch (one matrix)"] = biggest
    if sub:
        fixed[f"draft substitutes ({L - n_res} streamed layers)"] = (L - n_res) * sub
    streamed = list(range(n_res, L))
    if offload == "disk":
        n_ram = 0
    elif offload == "ram":
        n_ram = len(streamed)
        if sum(sizes[i] for i in streamed) > ram_bytes:
            raise UserError(f"--offload ram: {n_ram} layers need {fmt_bytes(sum(sizes[i] for i in streamed))} of "
                            f"RAM, more than --ram {fmt_bytes(ram_bytes)}")
    else:
        n_ram = 0
        while n_ram < len(streamed) and sum(sizes[i] for i in streamed[:n_ram + 1]) <= ram_bytes:
            n_ram += 1
    return PlacementPlan(L, layer, tuple(range(n_res)), tuple(streamed[:n_ram]), tuple(streamed[n_ram:]),
                         buffers, fixed, vram_bytes, ram_bytes, resident_format=fmt, **common)


def _parts(parts: dict[str, int]) -> str:
    return " + ".join(f"{name} {fmt_bytes(b)}" for name, b in parts.items())


def default_budgets(device: torch.device) -> tuple[int, int]:
    """(device bytes, RAM bytes) free now, minus the stated margins.

    On the CPU the device *is* RAM: the whole free RAM is the device budget and the RAM tier gets
    nothing (a layer in RAM is simply resident there); pass --vram/--ram to emulate tiers.
    """
    import psutil
    free_ram = max(0, psutil.virtual_memory().available - RAM_MARGIN_BYTES)
    if device.type != "cuda":
        return free_ram, 0
    free_dev = _free_device_bytes(device)
    return max(0, free_dev - DEVICE_MARGIN_BYTES), free_ram


def _free_device_bytes(device: torch.device) -> int:
    """Free bytes on the device as the CUDA runtime sees them (it honours CUDA_VISIBLE_DEVICES);
    NVML as a fallback."""
    try:
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    except RuntimeError:
        import pynvml
        pynvml.nvmlInit()
        index = device.index if device.index is not None else 0
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
