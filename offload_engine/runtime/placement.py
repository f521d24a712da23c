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
from ..formats.config import ModelConfig
from .layer_store import LayerLayout

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
    layer_bytes: int  # one packed layer block (4 KiB aligned)
    resident_layers: tuple[int, ...]
    ram_layers: tuple[int, ...]
    disk_layers: tuple[int, ...]
    buffers: int  # device layer buffers (0 when nothing streams)
    fixed_bytes: dict[str, int] = field(default_factory=dict)  # resident non-layer parts by name
    vram_budget_bytes: int = 0
    ram_budget_bytes: int = 0

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.ram_layers + self.disk_layers))

    @property
    def vram_bytes(self) -> int:
        return sum(self.fixed_bytes.values()) + len(self.resident_layers) * self.layer_bytes

    @property
    def ram_bytes(self) -> int:
        return len(self.ram_layers) * self.layer_bytes

    @property
    def disk_bytes(self) -> int:
        return len(self.disk_layers) * self.layer_bytes

    @property
    def bytes_per_pass(self) -> int:
        """Bytes copied into the device buffers by one target pass."""
        return len(self.streamed_layers) * self.layer_bytes

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
        lines.append(f"| {len(self.resident_layers)} resident layers | "
                     f"{fmt_bytes(len(self.resident_layers) * self.layer_bytes)} |")
        lines.append("")
        lines.append(f"layer block: {fmt_bytes(self.layer_bytes)}; {len(self.streamed_layers)} of "
                     f"{self.num_layers} layers streamed per pass = {fmt_bytes(self.bytes_per_pass)} per target pass")
        return "\n".join(lines)


def model_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of a whole model held resident in `dtype` (e.g. a draft): every tensor, no padding."""
    from ..formats.checkpoint import global_shapes, layer_shapes
    elt = torch.empty((), dtype=dtype).element_size()
    count = lambda shapes: sum(math.prod(s) for s in shapes.values())  # noqa: E731
    return (count(global_shapes(cfg)) + cfg.num_layers * count(layer_shapes(cfg))) * elt


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
              draft_kv_bytes: int = 0) -> PlacementPlan:
    """Decide each layer's tier. Refuses, naming the numbers, a plan that cannot fit.
    `layer_bytes` overrides the packed layer size (the simulator's quantised weights)."""
    if offload not in OFFLOAD_MODES:
        raise UserError(f"--offload {offload!r}: choose one of {', '.join(OFFLOAD_MODES)}")
    if buffers < 1:
        raise UserError(f"--buffers must be at least 1, got {buffers}")
    L = cfg.num_layers
    layer = layer_bytes if layer_bytes is not None else LayerLayout.for_config(cfg, dtype).block_bytes
    if cache_slots < 1:
        raise UserError(f"--cache-slots must be at least 1, got {cache_slots}")
    fixed = fixed_parts(cfg, dtype, max_context, max_batch_tokens, draft_bytes, cache_slots, draft_kv_bytes)
    need = sum(fixed.values())
    if offload == "none" or (offload == "auto" and need + L * layer <= vram_bytes):
        if need + L * layer > vram_bytes:
            raise UserError(f"--offload none: the whole model needs {fmt_bytes(need + L * layer)} on the device "
                            f"({fmt_bytes(L * layer)} of layers + {_parts(fixed)}), more than --vram "
                            f"{fmt_bytes(vram_bytes)}")
        return PlacementPlan(L, layer, tuple(range(L)), (), (), 0, fixed, vram_bytes, ram_bytes)
    fixed["layer buffers"] = buffers * layer
    need += buffers * layer
    if need > vram_bytes:
        raise UserError(f"--vram {fmt_bytes(vram_bytes)} is too small for the resident parts: "
                        f"{_parts(fixed)} = {fmt_bytes(need)}")
    n_res = min(L - 1, (vram_bytes - need) // layer) if offload == "auto" else 0
    streamed = list(range(n_res, L))
    if offload == "disk":
        n_ram = 0
    elif offload == "ram":
        n_ram = len(streamed)
        if n_ram * layer > ram_bytes:
            raise UserError(f"--offload ram: {n_ram} layers need {fmt_bytes(n_ram * layer)} of RAM, more than "
                            f"--ram {fmt_bytes(ram_bytes)}")
    else:
        n_ram = min(len(streamed), ram_bytes // layer)
    return PlacementPlan(L, layer, tuple(range(n_res)), tuple(streamed[:n_ram]), tuple(streamed[n_ram:]),
                         buffers, fixed, vram_bytes, ram_bytes)


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
