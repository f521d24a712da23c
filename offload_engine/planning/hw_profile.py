"""Hardware profiles: frozen dataclasses with the unit in every numeric field's name, read from
JSON with every field checked (`hw_profiles/`).

  * `GpuSpec` (`hw_profiles/gpus/*.json`): a GPU from its spec sheet and published
    measurements: VRAM, pinned host-to-device bandwidth, dense fp16 throughput, memory bandwidth,
    each number with its source. The simulator's input.
  * `MeasuredProfile` (the cache folder, written by `sequoia-offload profile`): one machine, one
    (target, draft) pair and one placement plan, measured: the streaming bandwidth, the target's
    pass time t(n) and the draft's level time by width. The optimizer's input for `--tree auto`.

A missing field, an unknown one, a number given as text or with another unit than the field's
(`vram_gb` where the field is `vram_gib`), or a negative or zero quantity is refused with the
file and the field's name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sequoia_trees.acceptance import AcceptanceVector

from ..errors import UserError
from ..fsutil import INSTALL_ROOT

PROFILES_DIR = INSTALL_ROOT / "hw_profiles"
GPU_DIR = PROFILES_DIR / "gpus"
MODEL_DIR = PROFILES_DIR / "models"
# unit suffixes of field names, longest first (so "_gb_per_s" wins over "_s")
UNITS = ("_gib_per_s", "_gb_per_s", "_mb_per_s", "_tflops", "_gflops", "_bytes", "_gib", "_gb", "_mib", "_mb",
         "_ms", "_s")


def _stem(name: str) -> tuple[str, str]:
    for unit in UNITS:
        if name.endswith(unit):
            return name[: -len(unit)], unit
    return name, ""


@dataclass(frozen=True)
class GpuSpec:
    name: str
    description: str
    vram_gib: float
    h2d_pinned_gb_per_s: float  # host-to-device copies from pinned memory, measured where published
    fp16_dense_tflops: float  # dense fp16 tensor-core throughput, fp32 accumulation
    mem_gb_per_s: float
    pcie: str
    sources: dict[str, str]
    kind: str = "gpu-spec"

    @property
    def vram_bytes(self) -> int:
        return int(self.vram_gib * 2**30)


@dataclass(frozen=True)
class MeasuredProfile:
    machine: str  # CPU model and count, GPU name: what the numbers belong to
    device: str
    dtype: str
    target: str
    target_fingerprint: str
    draft_key: str
    plan: dict[str, Any]  # resident / RAM / disk layer counts, bytes per pass, buffers
    stream_source: str  # "h2d-pinned", "o_direct-read" or "none" (nothing streams)
    stream_gb_per_s: float
    prefix_tokens: int
    target_tokens: tuple[int, ...]
    target_pass_s: tuple[float, ...]
    draft_widths: tuple[int, ...]
    draft_level_s: tuple[float, ...]
    step_residual_s: float  # the per-step constant of the step model (negative: overlap); sampled
    draft_level_greedy_s: tuple[float, ...]  # the draft's level time when decoding greedily
    step_residual_greedy_s: float
    measured_at: str
    measure_s: float
    kind: str = "measured"
    # the step model fitted to real steps (profiles before it lack these: no per-node term, the
    # draft's levels paid in full, plain steps costing their pass)
    step_per_node_s: float = 0.0
    step_per_node_greedy_s: float = 0.0
    draft_factor: float = 1.0  # the share of the draft's level time a real step pays
    draft_factor_greedy: float = 1.0
    plain_step_s: float = 0.0  # a real plain step minus its one-token pass
    plain_step_greedy_s: float = 0.0
    fit_budgets: tuple[int, ...] = ()  # the real steps timed: tree shapes (budget 1: plain)
    fit_depths: tuple[int, ...] = ()
    fit_step_s: tuple[float, ...] = ()  # their medians, sampled and greedy
    fit_step_greedy_s: tuple[float, ...] = ()
    fit_cv_error: float = 0.0  # mean |predicted / measured - 1| over shapes left out of the fit
    fit_cv_error_greedy: float = 0.0
    # drafting while the target streams (profiles before it lack these: no overlap): per target
    # width, the seconds a pass waits for streamed layers (where the draft may grow the next
    # tree); the share of the draft work fitting there that the next step used, sampled, greedy
    target_idle_s: tuple[float, ...] = ()
    overlap_use: float = 0.0
    overlap_use_greedy: float = 0.0
    # the acceptance vectors that shaped the timed steps' trees, sampled and greedy (the pair's
    # own where it had one; profiles before them: profiler.PROFILE_VECTOR)
    fit_vector: tuple[float, ...] = ()
    fit_vector_greedy: tuple[float, ...] = ()
    # the speed check's readings taken when the profile was measured, with the check's own jobs
    # (`profiler.speed_now`: the one-token target pass and the draft's 16-wide greedy level, each
    # the median of five back to back); 0: not taken (a pass too long to check)
    check_target_s: float = 0.0
    check_draft_s: float = 0.0
    # the passes whose median sat off the line through their neighbours' and were timed again
    # back to back with them (`profiler.retime_bumps`): their widths and their medians before
    target_retimed: tuple[int, ...] = ()
    target_retimed_from_s: tuple[float, ...] = ()

    def timings(self, greedy: bool = False):
        """The optimizer's input for greedy or sampled decoding: times made non-decreasing in
        width (a wider pass is never cheaper; a noisy dip would otherwise be chosen)."""
        from itertools import accumulate

        from sequoia_trees.optimizer import Timings
        g = greedy
        draft = self.draft_level_greedy_s if g else self.draft_level_s
        return Timings(tuple(self.target_tokens), tuple(accumulate(self.target_pass_s, max)),
                       tuple(self.draft_widths), tuple(accumulate(draft, max)),
                       self.step_residual_greedy_s if g else self.step_residual_s,
                       self.step_per_node_greedy_s if g else self.step_per_node_s,
                       self.draft_factor_greedy if g else self.draft_factor,
                       self.plain_step_greedy_s if g else self.plain_step_s,
                       tuple(self.target_idle_s), self.overlap_use_greedy if g else self.overlap_use)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


# numeric fields that may be zero; one that may be negative; every other number must be > 0
_MAY_BE_ZERO = {"stream_gb_per_s", "measure_s", "draft_factor", "draft_factor_greedy", "fit_cv_error",
                "fit_cv_error_greedy", "target_idle_s", "overlap_use", "overlap_use_greedy", "fit_vector",
                "fit_vector_greedy", "check_target_s", "check_draft_s"}
_SIGNED = {"step_residual_s", "step_residual_greedy_s", "step_per_node_s", "step_per_node_greedy_s", "plain_step_s",
           "plain_step_greedy_s"}


def _shown(value: Any) -> str:
    """A value for a message: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_number(path: Path, key: str, value: Any, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        unit = f" (in {unit.lstrip('_').replace('_', ' ')})" if unit else ""
        raise UserError(f"{path}: field {key!r} must be a number{unit}, got {_shown(value)}")
    value = float(value) if abs(value) < 1e300 else math.inf
    if key in _SIGNED:
        if not math.isfinite(value):
            raise UserError(f"{path}: field {key!r} must be a finite number, got {value}")
        return value
    if not math.isfinite(value) or value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
        raise UserError(f"{path}: field {key!r} must be {'>= 0' if key in _MAY_BE_ZERO else 'positive'}, "
                        f"got {value}")
    return value


def from_dict(cls, data: Any, path: Path):
    """Build `cls` from parsed JSON, checking every field (see the module's docstring)."""
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    stems = {_stem(n)[0]: n for n in fields}
    for key in data:
        if key in fields:
            continue
        stem, unit = _stem(key)
        if stem in stems and unit:
            raise UserError(f"{path}: field {key!r} has the wrong unit: this field is {stems[stem]!r}")
        raise UserError(f"{path}: unknown field {key!r}")
    values = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is not dataclasses.MISSING:
                continue
            raise UserError(f"{path}: field {name!r} is missing")
        value = data[name]
        unit = _stem(name)[1]
        is_list = str(f.type).startswith("tuple")
        if is_list and value == [] and f.default == ():  # an optional list, given empty
            values[name] = ()
            continue
        if is_list and not isinstance(value, list):
            raise UserError(f"{path}: field {name!r} must be a list, got {_shown(value)}")
        if unit:
            if is_list:
                value = tuple(_check_number(path, name, v, unit) for v in value)
                if not value:
                    raise UserError(f"{path}: field {name!r} is empty")
            else:
                value = _check_number(path, name, value, unit)
        elif str(f.type).startswith("tuple[int"):  # counts (tokens, widths): positive integers
            if not isinstance(value, list) or not value or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
                raise UserError(f"{path}: field {name!r} must be a list of positive whole numbers, got {_shown(value)}")
            value = tuple(value)
        elif f.type == "float":  # a number without a unit (a factor, a fraction)
            value = _check_number(path, name, value, "")
        elif f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise UserError(f"{path}: field {name!r} must be a positive whole number, got {_shown(value)}")
        elif f.type == "str" and not isinstance(value, str):
            raise UserError(f"{path}: field {name!r} must be text, got {_shown(value)}")
        elif str(f.type).startswith("dict") and not isinstance(value, dict):
            raise UserError(f"{path}: field {name!r} must be an object, got {_shown(value)}")
        values[name] = value
    if values.get("kind", fields["kind"].default) != fields["kind"].default:
        raise UserError(f"{path}: field 'kind' is {values['kind']!r}, expected {fields['kind'].default!r}")
    return cls(**values)


def _read(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON, a 5000-digit number
        raise UserError(f"{path}: cannot read the profile ({e})") from None


def load_gpu_spec(name_or_path: str | Path) -> GpuSpec:
    """A shipped spec sheet by name (`rtx4090`) or any JSON file of the same form."""
    path = Path(name_or_path)
    if not path.suffix:
        path = GPU_DIR / f"{str(name_or_path).lower()}.json"
        if not path.exists():
            raise UserError(f"--gpu {name_or_path}: no such profile; shipped: {', '.join(gpu_names())}")
    spec = from_dict(GpuSpec, _read(path), path)
    numeric = [f.name for f in dataclasses.fields(GpuSpec) if _stem(f.name)[1]]
    missing = [n for n in numeric if not str(spec.sources.get(n, "")).strip()]
    if missing:
        raise UserError(f"{path}: field 'sources' gives no source for {', '.join(missing)}")
    return spec


def gpu_names() -> list[str]:
    return sorted(p.stem for p in GPU_DIR.glob("*.json"))


def load_measured(path: Path) -> MeasuredProfile:
    data = _read(path)
    prof = from_dict(MeasuredProfile, data, path)
    for xs, ys in (("target_tokens", "target_pass_s"), ("draft_widths", "draft_level_s"),
                   ("draft_widths", "draft_level_greedy_s"), ("fit_budgets", "fit_depths"), ("fit_budgets", "fit_step_s"),
                   ("fit_budgets", "fit_step_greedy_s"), ("target_retimed", "target_retimed_from_s")):
        if len(getattr(prof, xs)) != len(getattr(prof, ys)):
            raise UserError(f"{path}: fields {xs!r} and {ys!r} differ in length")
    try:
        prof.timings(greedy=True), prof.timings(greedy=False)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    vectors = {}
    for name in ("fit_vector", "fit_vector_greedy"):
        probs = getattr(prof, name)
        try:
            if probs:
                AcceptanceVector(tuple(_check_number(path, name, p, "") for p in probs))
        except ValueError as e:
            raise UserError(f"{path}: field {name!r} is not an acceptance vector ({e})") from None
        vectors[name] = tuple(float(p) for p in probs)
    return dataclasses.replace(prof, **vectors)


@dataclass(frozen=True)
class ModelShape:
    name: str
    config: dict = field(repr=False)
    hf_repo: str = ""
    source: str = ""
    kind: str = "model-shape"


def model_names() -> list[str]:
    return sorted(p.stem for p in MODEL_DIR.glob("*.json"))


def load_model_shape(name: str):
    """(ModelShape, ModelConfig) of a preset (`llama-2-70b`), parsed by the same code as a
    checkpoint's config.json."""
    import tempfile

    from ..formats.config import load_config
    path = MODEL_DIR / f"{name.lower()}.json"
    if not path.exists():
        raise UserError(f"model {name!r}: no such preset; shipped: {', '.join(model_names())}")
    data = _read(path)
    shape = ModelShape(**{k: data[k] for k in ("name", "config", "hf_repo", "source", "kind") if k in data})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(shape.config))
        cfg = load_config(tmp)
    return shape, cfg
