"""How fast will a model run on a GPU and RAM I do not have? (`sequoia-offload simulate`)

The same placement planner and optimizer as the real engine, fed timings from one of two places:
  * a spec-sheet GPU profile (`hw_profiles/gpus/`) and model-shape presets (`hw_profiles/models/`):
    timings are modelled (below);
  * a measured profile (`sequoia-offload profile --out FILE`, `--profile FILE`): the machine's own
    t_target(n), t_draft(w) and step overhead, as `--tree auto` uses them.

The model of a target pass over n tokens, layer by layer (REFERENCES.md 3):
  * a resident layer costs its compute: max(2 * params * n / (peak fp16 FLOP/s * mfu),
    weight bytes / memory bandwidth) + a fixed per-layer kernel-launch overhead;
  * a streamed layer (two device buffers, the next copy overlapping this compute) costs
    max(its copy, its compute): copy = bytes / host-to-device bandwidth from pinned RAM, or
    bytes / min(NVMe read, host-to-device) from disk;
  * plus the head over n rows. A draft level of w nodes is a resident pass of the draft over w.
`--draft self-q4` / `self-q8` (substitute self-drafts): the draft is the target's own resident
layers and an int4 / int8 copy of each streamed one, on the target's KV cache; the plan counts a
substitute per streamed layer (and says so when even the substitutes do not fit), and a draft
level runs the resident layers at their cost and the substitutes at theirs.
With a substitute self-draft the draft also grows the next tree while the target's pass waits
for streamed layers (`--overlap`, on by default for them, as in the engine): a pass's idle time
is the sum over its streamed layers (but the last IDLE_TAIL_LAYERS, where the engine grows
nothing) of max(0, copy - compute); the share of the draft work fitting there that the next
step uses is the probability that the step ends as one of the cases grown (the AHEAD_JOBS most
probable (end node, bonus) cases by the acceptance vector, fewer where a level is wide: at most
AHEAD_WIDTH nodes a batched level), a batched level costing what one tree's level costs (a GPU
level is memory-bound at these widths); the step is max(pass, overlapped work in its waits) +
the draft work that cannot overlap (`Timings.step`).
`--precision int8|int4` streams (and keeps resident) the target's layers at that size (int4:
groups of 64, scales and minima in fp16): only the bytes change; compute stays fp16.
`--precision q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q5_k|q6_k` are the GGUF block formats the runtime
streams as they are (runtime/blocks.py), at their real bits per weight (q4_k: 4.5; norms fp16);
each layer also pays its dequantization into fp16 weights (the fused kernel reads the blocks and
writes 2 bytes a weight at memory bandwidth) before the fp16 matmuls read those.
Assumptions, all flags: mfu 0.5, 0.1 ms per layer of launch overhead, NVMe 6 GB/s, a 1 ms step
overhead per speculation step, 8 GiB of host RAM kept for the OS.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.dp import optimal_tree
from sequoia_trees.optimizer import (Choice, Timings, choose, evaluate, step_tokens_distribution,
                                     tokens_per_step_for)

from ..errors import UserError
from ..formats.checkpoint import global_shapes, layer_shapes
from ..formats import gguf_blocks
from ..formats.config import ModelConfig
from ..runtime.placement import DEVICE_MARGIN_BYTES, GIB, PlacementPlan, fmt_bytes, largest_matrix_bytes, make_plan
from ..runtime.quant import quantized_bytes
from ..speculation.acceptance_store import known_vectors, nearest, read_vector
from .auto_tree import budget_grid
from .hw_profile import PROFILES_DIR, GpuSpec, MeasuredProfile, load_gpu_spec, load_model_shape

TARGET_WIDTHS = (1, 16, 32, 64, 128, 256, 512, 768, 1024)
DRAFT_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GGUF_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
PRECISIONS = {"fp16": 2.0, "int8": 1.0, "int4": 0.5,
              **{f: gguf_blocks.bits_per_weight(f.upper()) / 8 for f in GGUF_FORMATS}}  # bytes a weight
PUBLISHED_DIR = PROFILES_DIR / "published"
DEFAULT_ACCEPTANCE = PUBLISHED_DIR / "sequoia-paper__llama3-70b-instruct__llama3-8b-instruct__t0.json"


@dataclass(frozen=True)
class Assumptions:
    mfu: float = 0.5  # fraction of the peak fp16 throughput a layer's matmuls reach
    layer_overhead_s: float = 1e-4  # kernel launches per decoder layer per pass
    nvme_gb_per_s: float = 6.0
    step_overhead_s: float = 1e-3
    host_reserve_bytes: int = 8 * GIB
    max_context: int = 2048


def layer_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in layer_shapes(cfg).values())


def layer_bytes(cfg: ModelConfig, precision: str) -> int:
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    total = 0
    for name, shape in layer_shapes(cfg).items():
        if len(shape) == 2 and precision in GGUF_FORMATS:
            total += math.ceil(math.prod(shape) * PRECISIONS[precision])
        elif len(shape) == 2 and precision != "fp16":
            total += quantized_bytes(shape[0], shape[1], precision, 64)
        else:
            total += math.prod(shape) * 2
    return total


def dequant_s(cfg: ModelConfig, precision: str, gpu: GpuSpec) -> float:
    """One layer's blocks turned into fp16 weights: read the blocks, write 2 bytes a weight."""
    if precision not in GGUF_FORMATS:
        return 0.0
    return (layer_bytes(cfg, precision) + 2 * layer_params(cfg)) / (gpu.mem_gb_per_s * 1e9)


def model_bytes(cfg: ModelConfig, precision: str) -> int:
    glob = sum(math.prod(s) for s in global_shapes(cfg).values()) * 2
    return glob + cfg.num_layers * layer_bytes(cfg, precision)


def _compute_s(params: int, weight_bytes: int, n: int, gpu: GpuSpec, a: Assumptions) -> float:
    flops = 2.0 * params * n
    return max(flops / (gpu.fp16_dense_tflops * 1e12 * a.mfu), weight_bytes / (gpu.mem_gb_per_s * 1e9))


def _head_s(cfg: ModelConfig, n: int, gpu: GpuSpec, a: Assumptions) -> float:
    p = cfg.vocab_size * cfg.hidden_size
    return _compute_s(p, 2 * p, n, gpu, a) + a.layer_overhead_s


def _layer_s(cfg: ModelConfig, precision: str, n: int, gpu: GpuSpec, a: Assumptions) -> tuple[float, float, float]:
    """(compute, copy from RAM, copy from disk) seconds of one target layer over n tokens."""
    params, lb = layer_params(cfg), layer_bytes(cfg, precision)
    if precision in GGUF_FORMATS:  # dequantized, then fp16 matmuls over the dense weights
        compute = _compute_s(params, 2 * params, n, gpu, a) + dequant_s(cfg, precision, gpu) + a.layer_overhead_s
    else:
        compute = _compute_s(params, lb, n, gpu, a) + a.layer_overhead_s
    return (compute, lb / (gpu.h2d_pinned_gb_per_s * 1e9),
            lb / (min(a.nvme_gb_per_s, gpu.h2d_pinned_gb_per_s) * 1e9))


def target_pass_s(cfg: ModelConfig, plan: PlacementPlan, precision: str, n: int, gpu: GpuSpec,
                  a: Assumptions) -> float:
    compute, ram_copy, disk_copy = _layer_s(cfg, precision, n, gpu, a)
    t = len(plan.resident_layers) * compute
    t += len(plan.ram_layers) * max(ram_copy, compute) + len(plan.disk_layers) * max(disk_copy, compute)
    return t + _head_s(cfg, n, gpu, a)


def pass_idle_s(cfg: ModelConfig, plan: PlacementPlan, precision: str, n: int, gpu: GpuSpec,
                a: Assumptions) -> float:
    """Seconds of a target pass over n tokens spent waiting for streamed layers where the draft
    may work (every streamed layer's max(0, copy - compute) but the last IDLE_TAIL_LAYERS')."""
    from ..runtime.streamer import IDLE_TAIL_LAYERS
    compute, ram_copy, disk_copy = _layer_s(cfg, precision, n, gpu, a)
    last = cfg.num_layers - IDLE_TAIL_LAYERS
    return (sum(1 for i in plan.ram_layers if i < last) * max(0.0, ram_copy - compute)
            + sum(1 for i in plan.disk_layers if i < last) * max(0.0, disk_copy - compute))


def overlap_use(tree, vector: AcceptanceVector) -> float:
    """The share of the draft work fitting in a pass's waits that the next step uses, as the
    engine grows it (`SpeculativeDecoder._grow_ahead`): the probability that a step over `tree`
    ends as one of the cases grown, AHEAD_JOBS of them, fewer where the tree's widest level
    leaves room for fewer in AHEAD_WIDTH nodes."""
    from sequoia_trees.optimizer import level_widths
    from sequoia_trees.tree import ahead_hit_probability

    from ..speculation.decoder import AHEAD_GUESSES, AHEAD_JOBS, AHEAD_WIDTH
    if tree.size <= 1:
        return 0.0
    jobs = max(1, min(AHEAD_JOBS, AHEAD_WIDTH // max(level_widths(tree))))
    return ahead_hit_probability(tree, vector, jobs, AHEAD_GUESSES)


SUBSTITUTES = {"self-q4": "int4", "self-q8": "int8"}


def substitute_level_s(cfg: ModelConfig, plan: PlacementPlan, precision: str, scheme: str, w: int, gpu: GpuSpec,
                       a: Assumptions) -> float:
    """A substitute self-draft's level over w nodes: the resident layers as the target runs them,
    each streamed layer's quantised copy at its bytes."""
    params = layer_params(cfg)
    if precision in GGUF_FORMATS:
        resident = _compute_s(params, 2 * params, w, gpu, a) + dequant_s(cfg, precision, gpu) + a.layer_overhead_s
    else:
        resident = _compute_s(params, layer_bytes(cfg, precision), w, gpu, a) + a.layer_overhead_s
    sub = _compute_s(params, layer_bytes(cfg, scheme), w, gpu, a) + a.layer_overhead_s
    n_res = len(plan.resident_layers)
    return n_res * resident + (cfg.num_layers - n_res) * sub + _head_s(cfg, w, gpu, a)


def draft_level_s(cfg: ModelConfig, precision: str, w: int, gpu: GpuSpec, a: Assumptions) -> float:
    """A resident draft's level over w nodes; a draft kept in GGUF blocks dequantizes each layer
    per use (runtime/blocks.PackedWeight)."""
    if precision in GGUF_FORMATS:
        params = layer_params(cfg)
        compute = _compute_s(params, 2 * params, w, gpu, a) + dequant_s(cfg, precision, gpu) + a.layer_overhead_s
    else:
        compute = _compute_s(layer_params(cfg), layer_bytes(cfg, precision), w, gpu, a) + a.layer_overhead_s
    return cfg.num_layers * compute + _head_s(cfg, w, gpu, a)


@dataclass(frozen=True)
class Simulation:
    setting: dict
    plan: PlacementPlan | None
    timings: Timings
    acceptance: AcceptanceVector
    acceptance_source: str
    choice: Choice
    plain_seconds_per_token: float

    @property
    def speedup(self) -> float:
        return self.plain_seconds_per_token / self.choice.seconds_per_token

    def as_dict(self) -> dict:
        c = self.choice
        plan = None if self.plan is None else {
            "resident_layers": len(self.plan.resident_layers), "ram_layers": len(self.plan.ram_layers),
            "disk_layers": len(self.plan.disk_layers), "layer_bytes": self.plan.layer_bytes,
            "bytes_per_pass": self.plan.bytes_per_pass, "vram_bytes": self.plan.vram_bytes,
            "fixed_bytes": self.plan.fixed_bytes}
        return {"setting": self.setting, "plan": plan, "acceptance": list(self.acceptance.probs),
                "acceptance_source": self.acceptance_source,
                "timings": dataclasses.asdict(self.timings),
                "tree": {"budget": c.budget, "depth": c.depth, "level_widths": list(c.level_widths)},
                "tokens_per_step": c.tokens_per_step, "seconds_per_step": c.seconds_per_step,
                "target_seconds": c.target_seconds, "draft_seconds": c.draft_seconds,
                "draft_overlapped_seconds": c.overlap_seconds,
                "seconds_per_token": c.seconds_per_token, "tokens_per_second": c.tokens_per_second,
                "plain_seconds_per_token": self.plain_seconds_per_token, "speedup": self.speedup}

    def report(self) -> str:
        c, s = self.choice, self.setting
        lines = [f"setting: {', '.join(f'{k}={v}' for k, v in s.items())}"]
        if self.plan is not None:
            lines += ["", self.plan.table(), ""]
        lines.append(f"acceptance: {self.acceptance_source}: p_1..p_8 = "
                     f"[{', '.join(f'{p:.3f}' for p in self.acceptance.probs[:8])}]")
        lines.append("t_target(n): " + ", ".join(f"{n}: {t:.3f} s" for n, t in
                                                  zip(self.timings.target_tokens, self.timings.target_seconds)))
        if self.timings.overlap_use:
            t = self.timings
            lines.append(f"overlap: a pass over {c.budget} tokens waits {t.idle(c.budget):.3f} s for streamed layers; "
                         f"the draft grows the next tree there, {t.overlap_use:.0%} of it used by the next step "
                         f"(the cases grown that come)")
        lines.append(f"chosen {c.describe()}")
        lines.append(f"plain offloaded decoding: {self.plain_seconds_per_token:.3f} s/token; with the tree: "
                     f"{c.seconds_per_token:.3f} s/token ({c.tokens_per_second:.2f} tokens/s), "
                     f"{self.speedup:.2f}x faster")
        return "\n".join(lines)


def read_acceptance(path: str | Path | None) -> tuple[AcceptanceVector, str]:
    p = Path(path) if path else DEFAULT_ACCEPTANCE
    vector, data = read_vector(p)
    note = f" ({' '.join(str(data['note']).split())[:200]})" if data.get("note") else ""
    return vector, f"{p.name}{note}"


def _fixed_or_chosen(vector: AcceptanceVector, timings: Timings, tree: tuple[int, int] | None,
                     tokens_per_step: float | None, max_budget: int, max_depth: int,
                     length: int | None = None) -> Choice:
    """`length`: the tokens a generation's steps make (None: many; `optimizer`'s docstring)."""
    if max_budget < 1 or max_depth < 1:
        raise UserError(f"--max-budget and --max-depth must be >= 1, got {max_budget}, {max_depth}")
    if tree is None:
        if tokens_per_step is not None:
            raise UserError("--tokens-per-step needs --tree N,D (a fixed tree whose tokens per step is known)")
        budgets = tuple(n for n in budget_grid(max_budget) if n <= max_budget)
        return choose(vector, timings, budgets=budgets, max_depth=max_depth, length=length)
    n, d = tree
    widest = timings.target_tokens[-1]
    if not (2 <= n <= widest and d >= 2):
        raise UserError(f"--tree {n},{d}: give 2..{widest} nodes and at least 2 levels")
    if tokens_per_step is not None and not 1 <= tokens_per_step <= n:
        raise UserError(f"--tokens-per-step {tokens_per_step}: a step of {n} nodes makes 1..{n} tokens")
    try:
        plan_tree = optimal_tree(vector, n, d)
    except ValueError as e:
        raise UserError(f"--tree {n},{d}: {e}") from None
    step, t_target, t_draft, widths = evaluate(plan_tree, timings)
    value = tokens_per_step if tokens_per_step is not None else plan_tree.expected_tokens
    if length is not None and tokens_per_step is None:
        value = tokens_per_step_for(step_tokens_distribution(plan_tree, vector), length)
    return Choice(n, d, value, step, t_target, t_draft, widths, plan_tree,
                  timings.overlapped(n, timings.draft_factor * t_draft), length=length,
                  tree_tokens=plan_tree.expected_tokens)


def simulate(gpu: str | GpuSpec, ram: int, model: str | ModelConfig, draft: str | ModelConfig | None,
             precision: str = "fp16",
             acceptance: str | Path | None = None, offload: str = "auto", vram: int | None = None,
             tree: tuple[int, int] | None = None, tokens_per_step: float | None = None,
             max_budget: int = 1024, max_depth: int = 24, assumptions: Assumptions = Assumptions(),
             draft_precision: str = "fp16", overlap: str = "auto") -> Simulation:
    """`overlap`: auto (on for the substitute self-drafts, as in the engine), on or off."""
    a = assumptions
    if overlap not in ("auto", "on", "off"):
        raise UserError(f"--overlap must be auto, on or off, got {overlap!r}")
    spec = gpu if isinstance(gpu, GpuSpec) else load_gpu_spec(gpu)
    cfg = model if isinstance(model, ModelConfig) else load_model_shape(model)[1]  # a preset, or a config
    scheme = SUBSTITUTES.get(draft) if isinstance(draft, str) else None
    draft_cfg = (draft if isinstance(draft, ModelConfig) else cfg if scheme else
                 load_model_shape(draft)[1] if draft else None)
    if draft_cfg is not None and draft_cfg.vocab_size != cfg.vocab_size:
        raise UserError(f"--draft {draft}: vocabulary of {draft_cfg.vocab_size} tokens, the target's has "
                        f"{cfg.vocab_size}: a draft must share the target's tokenizer")
    draft_b = model_bytes(draft_cfg, draft_precision) if draft_cfg is not None and not scheme else 0
    if draft_cfg is not None and draft_precision in GGUF_FORMATS:  # its per-use dense matrix
        draft_b += largest_matrix_bytes(draft_cfg, torch.float16)
    vram_b = vram if vram is not None else spec.vram_bytes - DEVICE_MARGIN_BYTES
    plan = make_plan(cfg, torch.float16, offload=offload, vram_bytes=vram_b,
                     ram_bytes=max(0, ram - a.host_reserve_bytes), buffers=2, max_context=a.max_context,
                     max_batch_tokens=max(TARGET_WIDTHS), draft_bytes=draft_b,
                     layer_bytes=layer_bytes(cfg, precision),
                     scratch_bytes=2 * layer_params(cfg) if precision in GGUF_FORMATS else 0,
                     substitute_bytes=layer_bytes(cfg, scheme) if scheme else 0)
    t_target = tuple(target_pass_s(cfg, plan, precision, n, spec, a) for n in TARGET_WIDTHS)
    vector, source = read_acceptance(acceptance)
    if draft_cfg is None:  # plain offloaded decoding only
        if tree is not None or tokens_per_step is not None:
            raise UserError("--tree and --tokens-per-step need a draft (--draft NAME)")
        timings = Timings(TARGET_WIDTHS, t_target, (1,), (0.0,), a.step_overhead_s)
        vector, source = AcceptanceVector((0.0,)), "none (no draft)"
        choice = choose(vector, timings)
    else:
        t_draft = tuple(substitute_level_s(cfg, plan, precision, scheme, w, spec, a) if scheme
                        else draft_level_s(draft_cfg, draft_precision, w, spec, a) for w in DRAFT_WIDTHS)
        timings = Timings(TARGET_WIDTHS, t_target, DRAFT_WIDTHS, t_draft, a.step_overhead_s)
        choice = _fixed_or_chosen(vector, timings, tree, tokens_per_step, max_budget, max_depth)
        if plan.streamed_layers and (overlap == "on" or (overlap == "auto" and scheme)):
            idle = tuple(pass_idle_s(cfg, plan, precision, n, spec, a) for n in TARGET_WIDTHS)
            for _ in range(4):  # the share used depends on the tree, the tree on the share
                use = overlap_use(choice.tree, vector)
                if use == timings.overlap_use and timings.idle_seconds:
                    break
                timings = replace(timings, idle_seconds=idle, overlap_use=use)
                choice = _fixed_or_chosen(vector, timings, tree, tokens_per_step, max_budget, max_depth)
            use = overlap_use(choice.tree, vector)
            if use != timings.overlap_use and choice.budget > 1:  # (no fixed point: the last tree at its own share)
                timings = replace(timings, overlap_use=use)
                choice = _fixed_or_chosen(vector, timings, (choice.budget, choice.depth), tokens_per_step,
                                          max_budget, max_depth)
    setting = {"gpu": spec.name, "ram": fmt_bytes(ram), "model": _label(model), "draft": _label(draft),
               "precision": precision,
               "draft_precision": draft_precision,
               "offload": offload, "overlap": overlap, **{k: v for k, v in dataclasses.asdict(a).items()}}
    return Simulation(setting, plan, timings, vector, source, choice, t_target[0])


def _label(model) -> str | None:
    return f"{model.model_type} ({model.num_layers} layers)" if isinstance(model, ModelConfig) else model


def simulate_measured(profile: MeasuredProfile, acceptance: str | Path | None, temperature: float = 0.0,
                      tree: tuple[int, int] | None = None, tokens_per_step: float | None = None,
                      max_budget: int = 1024, max_depth: int = 24, length: int | None = None,
                      timings: Timings | None = None) -> Simulation:
    """The prediction from a machine's measured profile: what `--tree auto` chooses there, with
    the pair's own vector (stored or cached, found by the profile's fingerprints, the one nearest
    `temperature`) unless `acceptance` names a file; greedy timings at temperature 0 (or `timings`
    given: the step model a loaded engine plans with, `AutoPlan.timings`, which its load's speed
    check may have rescaled); for generations whose steps make `length` tokens (None: many)."""
    timings = timings or profile.timings(greedy=temperature == 0)
    if acceptance is not None:
        vector, source = read_acceptance(acceptance)
    else:
        found = known_vectors(profile.target_fingerprint, profile.draft_key)
        if not found:
            raise UserError(f"no acceptance vector is stored for the profile's pair ({Path(profile.target).name}, "
                            f"{profile.draft_key}): give --acceptance FILE")
        vector, path, _ = nearest(found, temperature)
        source = path.name
    choice = _fixed_or_chosen(vector, timings, tree, tokens_per_step, min(max_budget, timings.target_tokens[-1]),
                              max_depth, length)
    setting = {"profile": profile.machine, "device": profile.device, "target": Path(profile.target).name,
               "draft": profile.draft_key, "plan": profile.plan}
    return Simulation(setting, None, timings, vector, source, choice, timings.target(1))
