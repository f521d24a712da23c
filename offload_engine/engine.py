"""The public API: `Engine.load(...)` then `engine.generate(...)`."""

from __future__ import annotations

import re
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from sequoia_trees.acceptance import AcceptanceVector, RankEvidence
from sequoia_trees.optimizer import DEFAULT_MAX_DEPTH
from sequoia_trees.sampling import SamplingParams

from .errors import UserError
from .formats.checkpoint import fingerprint, open_checkpoint
from .formats.config import ModelConfig, load_config, parse_dtype
from .formats.gguf_model import is_sidecar
from .formats.model_names import is_model_name, resolve_name
from .formats.detokenize import TextStream
from .formats.tokenizer import Tokenizer
from .planning.auto_tree import AUTO_MAX_BUDGET
from .runtime.blocks import parse_weights
from .runtime.layer_store import StoreLayout, store_layout
from .runtime.loader import OffloadOptions, load_target, make_placement
from .runtime.model import Transformer
from .runtime.placement import PlacementPlan, default_budgets, kv_cache_bytes, largest_matrix_bytes, model_bytes
from .runtime.quant import DEFAULT_GROUP_SIZE
from .speculation.acceptance_store import draft_key, nearest, stored_vectors
from .speculation.decoder import GENERIC_ACCEPTANCE, TREE_KINDS, PrefixCache, SpeculativeDecoder, TreeSpec
from .speculation.suffix import DEFAULT_MEMORY, MAX_PATTERN, SuffixDrafter, SuffixStore, split_draft
from .speculation.drafts import (SELF_DRAFTS, SUBSTITUTE_DRAFTS, build_self_draft, check_group_size, default_draft_dir,
                                 head_bytes, is_substitute_draft, self_draft_bytes, self_draft_scheme,
                                 substitute_layer_bytes)

DEFAULT_MAX_CONTEXT = 8192
OnToken = Callable[[int, str], None]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the new tokens only (an end-of-sequence token included when one ended it)
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length"
    stats: dict = field(default_factory=dict)


def resolve_target(target: str | Path | None, progress: bool = True) -> Path:
    """'default' (or None) is the embedded SmolLM2-135M-Instruct (its Q4_1 GGUF, used as it is);
    a .gguf file, or a folder holding one GGUF file and no config.json, is read in its own block
    formats through a small metadata folder (`formats.gguf_model`); anything else is a Hugging
    Face checkpoint folder."""
    from .formats import gguf_model
    if target is None or str(target) == "default":
        from .formats.default_model import default_model_dir
        return default_model_dir(progress=progress)
    if is_model_name(str(target)):  # a Hugging Face id in the local cache, or ollama:NAME[:TAG]
        found = resolve_name(str(target))
        if found.is_file():
            return gguf_model.sidecar_for(found, progress, name=_safe_stem(str(target)))
        target = found
    path = Path(target).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path}: not a model (give a checkpoint folder or a .gguf file)")
        return gguf_model.sidecar_for(path, progress)
    if not path.is_dir():
        raise UserError(f"checkpoint folder {path} does not exist")
    found = gguf_model.gguf_in(path)
    return gguf_model.sidecar_for(found, progress) if found is not None else path


def _safe_stem(name: str) -> str:
    """A model name as a folder name: 'ollama:llama3.1:70b' -> 'ollama-llama3.1-70b'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise UserError(f"device {device!r} is not a device name (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device} asked for, but torch sees no CUDA GPU")
    if device.type not in ("cuda", "cpu"):
        raise UserError(f"device {device} is not supported (use cpu or cuda)")
    return device


@dataclass(frozen=True)
class _Setup:
    folder: Path
    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_context: int
    opts: OffloadOptions
    plan: PlacementPlan
    draft_folder: Path | None = None
    draft_cfg: ModelConfig | None = None
    layout: StoreLayout | None = None


def _setup(target, device, dtype, max_context, offload, vram, ram, buffers, max_batch_tokens,
           progress, draft=None, draft_group_size: int = DEFAULT_GROUP_SIZE, cache_slots: int = 1,
           weights: str = "auto", verify_reads: bool = False) -> _Setup:
    """Everything Engine.load decides before loading a byte: checked flags, config and the plan."""
    dev = resolve_device(device)
    dt = parse_dtype(dtype, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if max_context is not None and max_context < 2:
        raise UserError(f"--max-context must be at least 2 tokens, got {max_context}")
    if max_batch_tokens < 1:
        raise UserError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    folder = resolve_target(target, progress)
    cfg = load_config(folder)
    limit = max_context or min(cfg.max_context, DEFAULT_MAX_CONTEXT)
    if limit > cfg.max_context:
        raise UserError(f"--max-context {limit} exceeds the model's limit of {cfg.max_context} tokens")
    opts = OffloadOptions(offload, vram, ram, buffers, max_batch_tokens, cache_slots=cache_slots,
                          weights=parse_weights(weights), verify_reads=verify_reads)
    ckpt = open_checkpoint(folder, cfg)
    try:  # each layer's stored formats and bytes, from the headers
        layout = store_layout(ckpt, dt, opts.weights)
    finally:
        ckpt.close()
    draft_bytes, draft_folder, draft_cfg = _draft_parts(draft, folder, cfg, dt, draft_group_size, progress)
    if self_draft_scheme(draft) is not None:  # its int8 head, where it has one (drafts.quantized_head)
        draft_bytes += head_bytes(cfg, dev)
    # the draft's own KV caches, one per slot (a self-draft has the target's shape); a substitute
    # draft has none (it shares the target's) and a quantised copy of each streamed layer only
    substitute = substitute_layer_bytes(cfg, dt, self_draft_scheme(draft), draft_group_size) \
        if is_substitute_draft(draft) else 0
    draft_kv = cache_slots * kv_cache_bytes(draft_cfg or cfg, dt, limit + max_batch_tokens) \
        if draft is not None and not substitute else 0
    plan = make_placement(cfg, dt, dev, opts, limit, draft_bytes, draft_kv, layout, substitute)
    return _Setup(folder, cfg, dev, dt, limit, opts, plan, draft_folder, draft_cfg, layout)


def _draft_parts(draft, target_folder: Path, cfg: ModelConfig, dtype: torch.dtype, group_size: int,
                 progress: bool) -> tuple[int, Path | None, ModelConfig | None]:
    """(resident bytes, folder, config) of the draft a --draft value names (see drafts.py)."""
    if draft is None:
        return 0, None, None
    scheme = self_draft_scheme(draft)
    if scheme is not None:
        if scheme == "int4":
            check_group_size(cfg, group_size)
        if is_substitute_draft(draft):  # counted per streamed layer by the plan
            return 0, None, None
        return self_draft_bytes(cfg, dtype, scheme, group_size), None, None
    if str(draft) == "default":
        folder = default_draft_dir(target_folder, progress)
    else:
        path, named = Path(draft).expanduser(), is_model_name(str(draft))
        if not named and not path.is_dir() and not (path.is_file() and path.suffix == ".gguf"):
            raise UserError(f"--draft {draft}: not a checkpoint folder, a .gguf file, a Hugging Face id "
                            f"(org/name), ollama:NAME, 'default', "
                            f"{', '.join(repr(k) for k in (*SELF_DRAFTS, *SUBSTITUTE_DRAFTS))}")
        folder = resolve_target(str(draft) if named else path, progress)
    draft_cfg = load_config(folder)
    if is_sidecar(folder):  # resident in its own block formats
        ckpt = open_checkpoint(folder, draft_cfg)
        try:
            layers = store_layout(ckpt, dtype).total_bytes
        finally:
            ckpt.close()
        return model_bytes(draft_cfg, dtype, layers) + largest_matrix_bytes(draft_cfg, dtype), folder, draft_cfg
    return model_bytes(draft_cfg, dtype), folder, draft_cfg


def choose_draft(target, load_kwargs: dict, temperature: float | None = None, extra: list[str] | None = None,
                 progress: bool = True, force: bool = False, budgets: dict | None = None,
                 length: int | None = None):
    """`--draft auto`'s table and choice for `target` (`planning.draft_choice`, handed Engine.load
    and plan_only to evaluate the candidates with)."""
    from .planning import draft_choice
    folder = resolve_target(target, progress)
    return draft_choice.choose_draft(folder, target is None or str(target) == "default", load_kwargs,
                                     load=Engine.load, plan=plan_only, temperature=temperature, extra=extra,
                                     progress=progress, force=force, budgets=budgets, length=length)


def plan_only(target="default", device=None, dtype=None, max_context=None, offload="auto", vram=None,
              ram=None, buffers=None, max_batch_tokens=1024, draft: str | Path | None = None,
              draft_group_size: int = DEFAULT_GROUP_SIZE, cache_slots: int = 1,
              weights: str = "auto") -> tuple[PlacementPlan, Path, torch.device, torch.dtype]:
    """The placement Engine.load would use, without loading anything (`sequoia-offload plan`).
    The draft (a folder, "default", "self-int8" or "self-int4") is counted as resident on the
    device: a folder in the compute dtype, a self-draft at its quantised size, with its KV caches."""
    if str(draft) == "auto":
        raise UserError("plan --draft auto: each candidate's plan is in the table `plan --draft auto` prints")
    draft, use_suffix = split_draft(None if str(draft) == "none" else draft)
    s = _setup(target, device, dtype, max_context, offload, vram, ram, buffers,
               max(max_batch_tokens, MAX_PATTERN + 1 if use_suffix else 1), True, draft, draft_group_size, cache_slots,
               weights)
    return s.plan, s.folder, s.device, s.dtype


def _overlap_on(plan: PlacementPlan, overlap: str, draft) -> bool:
    """--overlap for `draft` on `plan`: "on", or "auto" for a substitute draft; never when no
    layer streams (every pass has its layers at hand: nothing to overlap)."""
    return bool(plan.streamed_layers) and (overlap == "on" or (overlap == "auto" and is_substitute_draft(draft)))


def _tree_spec(kind: str, budget: int, depth: int, width: int, acceptance: AcceptanceVector | None) -> TreeSpec:
    if kind not in TREE_KINDS:
        raise UserError(f"--tree {kind!r}: choose one of {', '.join(TREE_KINDS)}")
    if budget < 1 or depth < 1 or width < 1:
        raise UserError(f"tree budget, depth and SpecInfer width must be >= 1, got {budget}, {depth}, {width}")
    spec = TreeSpec(kind, budget, depth, width, acceptance or GENERIC_ACCEPTANCE)
    try:
        spec.shape()
    except ValueError as e:  # e.g. a budget that no tree of that depth can hold
        raise UserError(f"--tree {kind} --tree-budget {budget} --tree-depth {depth}: {e}") from None
    return spec


def _usable_vectors(vectors: dict, spec: TreeSpec) -> dict:
    """The stored vectors that can shape a tree of the spec's budget and depth (a narrow one
    cannot fill a large budget within few levels); the others are left out, with a warning."""
    usable = {}
    for t, (vector, path) in vectors.items():
        try:
            replace(spec, acceptance=vector).shape()
            usable[t] = (vector, path)
        except ValueError as e:
            print(f"sequoia-offload: warning: stored acceptance vector {path.name} not used for "
                  f"--tree-budget {spec.budget} --tree-depth {spec.depth}: {e}", file=sys.stderr)
    return usable


def _check_same_vocabulary(folder: Path, cfg: ModelConfig, tokenizer: Tokenizer, draft_folder: Path,
                           draft_cfg: ModelConfig) -> None:
    """Verification compares token ids: the draft must share the target's vocabulary exactly."""
    draft_tok = Tokenizer.from_folder(draft_folder)
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise UserError(f"draft {draft_folder}: vocab_size {draft_cfg.vocab_size} differs from the target's "
                        f"{cfg.vocab_size} ({folder})")
    if draft_tok.tok.get_vocab(with_added_tokens=True) != tokenizer.tok.get_vocab(with_added_tokens=True):
        raise UserError(f"draft {draft_folder}: its tokenizer's vocabulary differs from the target's ({folder})")
    for name in ("bos_token", "eos_token"):
        if getattr(draft_tok, name) != getattr(tokenizer, name):
            raise UserError(f"draft {draft_folder}: {name} {getattr(draft_tok, name)!r} differs from the "
                            f"target's {getattr(tokenizer, name)!r}")


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, folder: Path, max_context: int,
                 plan: PlacementPlan, max_batch_tokens: int, draft: Transformer | None = None,
                 tree: TreeSpec = TreeSpec(), cache_slots: int = 1):
        self.model = model
        self.draft = draft
        self.tree = tree
        self.target_fingerprint: str | None = None
        self.draft_key: str | None = None
        self.draft_name: str | None = None  # the --draft value as given (a folder: its name), for display
        # measured vectors of this (target, draft) pair by temperature (acceptance_store); when
        # present they shape --tree sequoia, the one nearest each generation's temperature
        self.stored_acceptance: dict = {}
        self.auto_plans: dict = {}  # --tree auto: temperature -> auto_tree.AutoPlan
        self.draft_choice = None  # --draft auto: planning.draft_choice.DraftChoice
        # --draft auto: what each draft this engine has run learned (its plans and planners, kept
        # when another replaced it: `switch_draft`), the switches made, and the steps the current
        # draft has decoded since it was loaded (the evidence a switch waits for)
        self.draft_states: dict = {}
        self.draft_switches: list = []
        self.steps_with_draft = 0
        self.switch_failed: set = set()  # drafts a switch to failed in this run (not tried again)
        self._switch_due = None  # (planner, temperature, budget) of the answer just decoded (`generate`)
        self._load_args: dict = {}  # what a draft switch rebuilds a draft and its plans with
        # --tree auto with a cached profile: its readings timed again at load (profiler.SpeedCheck)
        self.speed_check = None
        self.step_check = None  # (`_plan_auto`: real steps of the chosen tree timed at load)
        # --tree auto: request temperature -> adaptive.OnlinePlanner (what it learned carries over)
        self.planners: dict = {}
        self.adapt = True  # --tree auto re-chooses the tree as it measures (False: --no-adapt)
        # the planners' first plain checks (PLAIN_CHECK_SAMPLES plain steps however fast the tree is
        # predicted: the yardstick of the stats line's speed-up); off where the caller times plain
        # decoding itself (`demo`, after its answer)
        self.first_plain_checks = True
        # --tree auto with `remember`: vector temperature -> (file, stored vector) of what its
        # planner learned (`planning.learned`)
        self.remember = False
        self.learned_paths: dict = {}
        self._learned_warned = False
        self.overlap = False  # the draft grows the next tree during the pass (Engine.load overlap=)
        self.overlap_gated = False  # --overlap auto: each step asks an `OverlapGate` (per draft and temperature)
        self.overlap_gates: dict = {}
        self.suffix_gated = False  # --draft suffix alone, --tree auto: a `SuffixGate` per temperature
        self.gates: dict = {}
        # --draft suffix / X+suffix: earlier requests' prompts and outputs, per store key
        self.suffix_store: SuffixStore | None = None
        # stops the loader thread when the engine is closed, collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, model.layers.close)
        self.plan = plan
        self.max_batch_tokens = max_batch_tokens
        self.tokenizer = tokenizer
        self.folder = folder
        self.max_context = max_context
        cfg = model.cfg
        eos = set(cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # the KV caches of the last generation, reused by the next one when its prompt extends
        # them (the next turn of a conversation); None turns prefix reuse off
        self.prefix_cache: PrefixCache | None = PrefixCache(max_context + max_batch_tokens, cache_slots)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @classmethod
    def load(cls, target: str | Path | None = "default", device: str | torch.device | None = None,
             dtype: str | torch.dtype | None = None, max_context: int | None = None, *,
             offload: str = "auto", vram: int | str | None = None, ram: int | str | None = None,
             buffers: int | None = None, max_batch_tokens: int = 1024, draft: str | Path | None = None,
             tree: str = "auto", tree_budget: int | None = None, tree_depth: int | None = None,
             specinfer_width: int = 4,
             acceptance: AcceptanceVector | None = None, draft_group_size: int = DEFAULT_GROUP_SIZE,
             cache_slots: int = 1, weights: str = "auto", adapt: bool = True,
             suffix_memory: int = DEFAULT_MEMORY, verify_reads: bool = False, overlap: str = "auto",
             progress: bool = True, draft_candidates: list[str] | None = None,
             draft_temperature: float | None = None, plan_tokens: int | None = None,
             remember: bool = False) -> "Engine":
        """Load a checkpoint folder (or "default") onto `device` in `dtype`.

        dtype defaults to bfloat16 on CUDA and float32 on the CPU; max_context to the model's
        own limit, capped at 8192 tokens. offload/vram/ram/buffers place the target's layers
        (see `offload_engine.runtime.placement`); vram and ram take bytes or sizes like "20GiB"; buffers
        defaults to 2 on CUDA and 6 on the CPU. With a `draft` (a checkpoint folder with the same
        tokenizer, "default" for the embedded pair's distilled draft, or "self-int8"/"self-int4"
        for a quantised copy of the target, int4 in groups of `draft_group_size`), kept resident,
        generation speculates with a tree of kind `tree` (see `speculation.decoder.TREE_KINDS`), by
        default "auto": Sequoia's tree with the size and depth the optimizer picks from this
        machine's profile and the pair's acceptance vectors (`auto_tree`), at most `tree_budget`
        nodes (default 1024) and `tree_depth` levels (default 24). Other kinds default to 64
        nodes and 8 levels. `cache_slots` conversations keep their KV caches for prefix reuse
        (each one reserved in the placement plan, for the target and the draft). `weights` is the
        format streamed layers are stored in (`runtime.blocks`: "auto" keeps the checkpoint's own,
        GGUF blocks included; "bf16", "f16", "f32", "q8_0", "q4_0", "q4_1" convert at store build).
        With tree "auto" and `adapt` (the default), each generation re-chooses the tree every few
        steps from what its steps measure (`planning.adaptive`); adapt=False keeps the choice fixed.
        draft "suffix" drafts from text already seen, with no model (`speculation.suffix`): the
        prompt and output so far and a store of earlier requests' (`suffix_memory` tokens at most);
        "X+suffix" grafts those drafts onto draft X's trees. Each streamed layer block is checked
        against its build-time checksum on its first read; `verify_reads` checks every disk read.
        `overlap` ("auto", "on", "off"): while the target's pass waits for streamed layers, the
        draft grows the next step's tree ahead (static trees; "auto": on for the substitute
        self-drafts "self-q8"/"self-q4", whose levels are the target's own resident layers).
        draft "auto" chooses the draft (`planning.draft_choice`): among the candidates (the
        self-drafts, the default draft, same-tokenizer models beside the target and
        `draft_candidates`, none), the one predicted fastest at `draft_temperature` (None: over
        T=0 and 0.6), each by its own profile and acceptance vectors. `plan_tokens`: the tokens the
        generations will ask for (max_new_tokens), when known: the tree (and draft) chosen at load,
        and the predictions printed for them, are for answers that long (None: long ones); with
        adaptation each generation re-chooses for its own max_new_tokens (adapt=False keeps the
        load-time choice for every generation). `remember` (the CLI's default but for `demo`; off here, so that
        a script's runs do not depend on earlier ones): with --tree auto and adaptation, what the
        planners learn (this pair's acceptance, the answers' lengths) is kept after every
        generation and the next load plans from it (`planning.learned`).
        """
        if plan_tokens is not None and plan_tokens < 1:
            raise UserError(f"plan_tokens must be >= 1, got {plan_tokens}")
        if overlap not in ("auto", "on", "off"):
            raise UserError(f"--overlap must be auto, on or off, got {overlap!r}")
        if str(draft) == "none":
            draft = None
        if str(draft) == "auto":  # the optimizer chooses the draft too (`planning.draft_choice`)
            kwargs = dict(device=device, dtype=dtype, max_context=max_context, offload=offload, vram=vram, ram=ram,
                          buffers=buffers, weights=weights, draft_group_size=draft_group_size,
                          cache_slots=cache_slots, tree_budget=tree_budget, tree_depth=tree_depth,
                          verify_reads=verify_reads, max_batch_tokens=max_batch_tokens, overlap=overlap)
            free_vram, free_ram = default_budgets(resolve_device(device))  # once, for every candidate alike
            budgets = {"vram": free_vram if vram is None else vram, "ram": free_ram if ram is None else ram}
            for again in (False, True):
                choice = choose_draft(target, kwargs, draft_temperature, draft_candidates, progress, force=again,
                                      budgets=budgets, length=plan_tokens)
                if progress:
                    print(f"sequoia-offload: {choice.summary()}", file=sys.stderr)
                try:
                    engine = cls.load(target, draft=None if choice.chosen == "none" else choice.chosen, tree=tree,
                                      specinfer_width=specinfer_width, acceptance=acceptance, adapt=adapt,
                                      suffix_memory=suffix_memory, progress=progress, plan_tokens=plan_tokens,
                                      remember=remember, **{**kwargs, **budgets})
                    break
                except UserError:
                    if again or choice.chosen == "none":
                        raise
                    # the cached choice no longer loads (a folder gone, less memory): choose again
            choice.refresh(engine)
            engine.draft_choice = choice
            return engine
        draft, use_suffix = split_draft(draft)
        if use_suffix and suffix_memory < 0:
            raise UserError(f"--suffix-memory must be >= 0 tokens, got {suffix_memory}")
        suffix_nodes = MAX_PATTERN if use_suffix else 0  # the most a suffix proposal adds to a pass
        auto = tree == "auto"
        if auto:
            cap_budget = AUTO_MAX_BUDGET if tree_budget is None else tree_budget
            cap_depth = DEFAULT_MAX_DEPTH if tree_depth is None else tree_depth
            if cap_budget < 1 or cap_depth < 1:
                raise UserError(f"--tree-budget and --tree-depth must be >= 1, got {cap_budget}, {cap_depth}")
            spec = TreeSpec("sequoia", cap_budget, cap_depth, specinfer_width, acceptance or GENERIC_ACCEPTANCE)
        else:
            spec = _tree_spec(tree, 64 if tree_budget is None else tree_budget, 8 if tree_depth is None else tree_depth,
                              specinfer_width, acceptance)
        widest = (spec.max_nodes if draft is not None else 1) + suffix_nodes
        s = _setup(target, device, dtype, max_context, offload, vram, ram, buffers,
                   max(max_batch_tokens, widest), progress, draft, draft_group_size, cache_slots, weights,
                   verify_reads)
        tokenizer = Tokenizer.from_folder(s.folder)
        if tokenizer.vocab_size > s.cfg.vocab_size:
            raise UserError(f"{s.folder}: tokenizer has {tokenizer.vocab_size} tokens but the model's "
                            f"vocab_size is {s.cfg.vocab_size}")
        draft_model = None
        if s.draft_folder is not None:
            _check_same_vocabulary(s.folder, s.cfg, tokenizer, s.draft_folder, s.draft_cfg)
            draft_ckpt = open_checkpoint(s.draft_folder, s.draft_cfg)
            try:
                draft_ckpt.check()
                draft_model = Transformer.from_checkpoint(draft_ckpt, s.dtype, s.device, packed=is_sidecar(s.draft_folder))
            finally:
                draft_ckpt.close()
        ckpt = open_checkpoint(s.folder, s.cfg)
        try:
            ckpt.check()  # every tensor present with the right shape, before any allocation
            model = load_target(ckpt, s.dtype, s.device, s.plan, s.opts, progress, s.layout)
            scheme = self_draft_scheme(draft)
            if scheme is not None:
                resident = ({i: model.layers.resident[i] for i in s.plan.resident_layers}
                            if is_substitute_draft(draft) else None)
                draft_model = build_self_draft(ckpt, model, scheme, draft_group_size, resident=resident)
        finally:
            ckpt.close()
        stored, target_fp, dkey = {}, None, None
        if draft_model is not None:
            target_fp, dkey = fingerprint(s.folder), draft_key(draft, s.draft_folder, draft_group_size,
                                                               len(s.plan.resident_layers))
            if tree == "sequoia" and acceptance is None:
                stored = _usable_vectors(stored_vectors(target_fp, dkey), spec)
        engine = cls(model, tokenizer, s.folder, s.max_context, s.plan, max(max_batch_tokens, widest),
                     draft_model, spec if draft_model is not None else TreeSpec(), cache_slots)
        engine.target_fingerprint, engine.draft_key, engine.stored_acceptance = target_fp, dkey, stored
        if draft_model is not None:  # (a model name whole; a folder or file by its name, a self-draft's is itself)
            engine.draft_name = ((str(draft) if is_model_name(str(draft)) else Path(draft).name)
                                 + ("+suffix" if use_suffix else ""))
        engine.adapt = adapt
        engine.remember = remember and adapt
        engine.overlap = _overlap_on(s.plan, overlap, draft)
        engine.overlap_gated = overlap == "auto"
        if use_suffix:
            engine.suffix_store = SuffixStore(suffix_memory)
            # --draft suffix alone: with --tree auto (and adaptation) each proposal is run, trimmed
            # or skipped by what the steps measure (`SuffixGate`); else SuffixDecoding's rule as is
            engine.suffix_gated = draft_model is None and auto and adapt
        if auto and draft_model is not None:
            engine._plan_auto(acceptance, cap_budget, cap_depth, progress, plan_tokens)
        engine._load_args = dict(group_size=draft_group_size, overlap=overlap, plan_tokens=plan_tokens,
                                 budget=cap_budget if auto else None, depth=cap_depth if auto else None,
                                 acceptance=acceptance, progress=progress)
        return engine

    def _plan_auto(self, acceptance: AcceptanceVector | None, max_budget: int, max_depth: int,
                   progress: bool, length: int | None = None) -> None:
        from .planning import auto_tree, learned, profiler
        from .planning.adaptive import expected_length
        from .speculation import measure
        # the vectors first: a profile measured now shapes its timed steps' trees by the pair's
        # own (`profiler.shaping_vectors`), the trees the optimizer will then choose among
        vectors = ({0.0: (acceptance, Path("given"))} if acceptance is not None
                   else measure.vectors_for(self, progress))
        prof, path, fresh = profiler.cached_or_measured(self, progress=progress)
        if progress:
            print(f"sequoia-offload: {'measured' if fresh else 'using'} the machine profile {path}", file=sys.stderr)
        # a cached profile of this machine: its cheapest readings timed again, and its parts
        # rescaled half the way to now (`profiler.speed_now`, CHECK_TRUST; a synthetic profile,
        # of another "machine", has nothing to compare with)
        self.speed_check = None
        this_machine = prof.machine == profiler.machine_name(self.model.device)
        if not fresh and this_machine:
            self.speed_check = profiler.speed_now(self, prof)
            prof = profiler.rescaled(prof, self.speed_check)
            if progress:
                print(f"sequoia-offload: {self.speed_check.describe()}", file=sys.stderr)
        # (the steps make the tokens after the prefill's first)
        steps_length = None if length is None else max(1, length - 1)
        self.auto_plans, self.learned_paths = {}, {}
        for t, (vector, vpath) in vectors.items():
            state, plan_length = None, steps_length
            if self.remember:  # what earlier runs' planners learned, where it fits (`planning.learned`)
                lpath = learned.path_for(self.target_fingerprint or "", self.draft_key or "", t, vector)
                self.learned_paths[t] = (lpath, vector)
                state, why = learned.load(lpath, vector)
                if why and progress:
                    print(f"sequoia-offload: not using {lpath} ({why}); the planner at T={t:g} starts from "
                          f"{Path(vpath).name}", file=sys.stderr)
                if state is not None:  # (the length as the planner will read it at its first answer)
                    plan_length = expected_length(state["ended"], 0, plan_length)
                    vector = learned.vector(state, vector)  # (`learned.load` made sure it makes one)
            plan = auto_tree.plan_auto({t: (vector, vpath)}, prof, max_budget, max_depth, plan_length)[t]
            if state is not None:
                plan = replace(plan, learned=state, source=f"{plan.source}, {learned.describe(state)}")
            if self.speed_check is not None:  # (the printed range: `auto_tree.speedup_spread`)
                plan = replace(plan, spell=self.speed_check.spell)
            self.auto_plans[t] = plan
        # real steps of the chosen tree timed now, in the spell the answers will run in, against
        # the (rescaled) profile's step model: every plan's trees rescaled part by part and chosen
        # again (`profiler.step_check`; a profile measured at this load too: five fresh profiles
        # put the answers' steps 9% slow, 2026-12-07)
        self.step_check = None
        if this_machine:  # (the plan of the lowest temperature whose tree pays)
            first = min(self.auto_plans.items(), key=lambda kv: (kv[1].choice.budget == 1, kv[0]))[1]
            self.step_check = profiler.step_check(self, first.timings, first.choice, first.candidates.acceptance,
                                                  greedy=first.temperature == 0, max_step_s=profiler.STEP_CHECK_MAX_S)
            if self.step_check is not None:
                sc = self.step_check
                self.auto_plans = {t: plan.retimed(plan.timings.scaled(sc.target, sc.draft, plan.timings.plain()))
                                   for t, plan in self.auto_plans.items()}
                if progress:
                    print(f"sequoia-offload: {sc.describe()}", file=sys.stderr)
        self.planners = {}  # made per request temperature on first use (`_planner`)
        if progress:
            for plan in self.auto_plans.values():
                print(f"sequoia-offload: {plan.describe()}", file=sys.stderr)

    def variant(self, *, draft: bool = True, tree: str | None = None, tree_budget: int | None = None,
                tree_depth: int | None = None, specinfer_width: int = 4, adapt: bool | None = None,
                overlap: str | None = None) -> "Engine":
        """Another decoding configuration over this engine's loaded models: the same target
        weights, layer executor, buffers, KV caches (the prefix cache: reuse between the two is
        exact, as between any two generations) and draft, with a tree, adaptation and planners
        of its own. `draft=False`: plain decoding (the draft sits unused); `tree`: a fixed
        tree kind with `tree_budget`/`tree_depth` (None: this engine's tree, `--tree auto`
        included, with fresh planners); `adapt`, `overlap`: as `Engine.load`'s (None: this
        engine's). Closing a variant closes nothing; the base engine owns the executor.

        For comparisons of decoding modes (`benchmarks/latency.py --auto-study`): on a 2-core
        machine two identical engines loaded in one process decoded 5-20% apart, persistently
        and not always the same one of the two, while one engine alternating between two labels
        measured 0.99-1.00x; variants hold the engine fixed and vary only the mode."""
        if self.suffix_store is not None:  # (its store and gate would be shared by every variant)
            raise UserError("Engine.variant: not for an engine with suffix drafts; load one engine per mode")
        v = object.__new__(Engine)
        v.__dict__.update(self.__dict__)
        v._base = self  # keeps the executor's owner alive
        v._finalizer = weakref.finalize(v, lambda: None)
        v.planners, v.gates, v.overlap_gates = {}, {}, {}
        v.remember = False  # (its planners start afresh from the load's state: they would overwrite the base's)
        v.draft_choice, v.draft_states, v.draft_switches = None, {}, []  # (a switch would change the base's draft)
        v.switch_failed, v._switch_due = set(), None
        if adapt is not None:
            v.adapt = adapt
        if overlap is not None:
            if overlap not in ("auto", "on", "off"):
                raise UserError(f"overlap must be auto, on or off, got {overlap!r}")
            v.overlap = self.draft is not None and _overlap_on(self.plan, overlap, self.draft_name)
            v.overlap_gated = overlap == "auto"
        if not draft or self.draft is None:
            if draft and tree not in (None, "none"):
                raise UserError(f"a {tree} tree needs a draft; this engine has none")
            v.draft, v.tree, v.auto_plans, v.stored_acceptance = None, TreeSpec(), {}, {}
            return v
        if tree is not None and tree != "auto":
            spec = _tree_spec(tree, 64 if tree_budget is None else tree_budget, 8 if tree_depth is None else tree_depth,
                              specinfer_width, None)
            if spec.max_nodes > self.max_batch_tokens:
                raise UserError(f"a tree of {spec.max_nodes} nodes; this engine was loaded for passes of at most "
                                f"{self.max_batch_tokens} tokens")
            v.tree, v.auto_plans = spec, {}
            v.stored_acceptance = (_usable_vectors(stored_vectors(self.target_fingerprint, self.draft_key), spec)
                                   if tree == "sequoia" else {})
        elif tree == "auto" and not self.auto_plans:
            raise UserError("--tree auto: this engine was not loaded with it (it has no auto plans)")
        return v

    def _build_draft(self, name: str) -> tuple[Transformer, Path | None]:
        """The model of draft `name` (a --draft value) beside this engine's loaded target, and its
        checkpoint folder (None: a self-draft)."""
        group = self._load_args.get("group_size", DEFAULT_GROUP_SIZE)
        scheme = self_draft_scheme(name)
        if scheme is not None:
            ckpt = open_checkpoint(self.folder, self.config)
            try:
                resident = ({i: self.model.layers.resident[i] for i in self.plan.resident_layers}
                            if is_substitute_draft(name) else None)
                return build_self_draft(ckpt, self.model, scheme, group, resident=resident), None
            finally:
                ckpt.close()
        _, folder, cfg = _draft_parts(name, self.folder, self.config, self.model.dtype, group, False)
        _check_same_vocabulary(self.folder, self.config, self.tokenizer, folder, cfg)
        ckpt = open_checkpoint(folder, cfg)
        try:
            ckpt.check()
            return Transformer.from_checkpoint(ckpt, self.model.dtype, self.model.device,
                                               packed=is_sidecar(folder)), folder
        finally:
            ckpt.close()

    def switch_draft(self, name: str, why: str = "") -> dict:
        """Put draft `name` (a --draft auto candidate on this engine's target plan) in place of the
        current one, between answers: the target, its placement and the conversations' target K/V
        stay; the old draft's model and K/V go (its plans and planners are kept in `draft_states`,
        so that a switch back goes on from what it learned); the new draft's plans come from its
        own cached profile and stored vectors (`_plan_auto`; a vector given at load was the loaded
        draft's), or from what it learned here before. Exactness is the verification's, as for
        any draft. A switch that fails (the draft cannot be built or planned) puts the old draft
        back as it was and raises UserError; if even that fails, the engine goes on without a
        draft (plain decoding) and says so. Returns the switch's record (also in `draft_switches`)."""
        if self.draft_choice is None or not self.auto_plans:
            raise UserError("switch_draft: only an engine loaded with --draft auto and --tree auto switches drafts")
        if self.suffix_store is not None:
            raise UserError("switch_draft: not with suffix drafts")
        old = self.draft_choice.chosen  # (candidates by their names in the table)
        by_name = {c.name: c for c in self.draft_choice.candidates}
        cand, mine = by_name.get(name), by_name.get(old)
        if name == old or cand is None or cand.dropped or name in ("none", "suffix") or (
                mine is not None and cand.plan != mine.plan):
            raise UserError(f"switch_draft: {name} is not another usable --draft auto candidate on this target "
                            f"plan (candidates: {', '.join(c.name for c in self.draft_choice.candidates)})")
        t0 = time.perf_counter()
        self.draft_states[old] = dict(display=self.draft_name, model_key=self.draft_key, auto_plans=self.auto_plans,
                                      planners=self.planners, learned_paths=self.learned_paths,
                                      overlap=self.overlap, speed_check=self.speed_check,
                                      step_check=self.step_check)
        self._free_draft()
        args = self._load_args
        try:
            model, folder = self._build_draft(name)
            self.draft = model
            self.draft_name = name if folder is None or is_model_name(name) else Path(name).name
            self.draft_key = draft_key(name, folder, args.get("group_size", DEFAULT_GROUP_SIZE),
                                       len(self.plan.resident_layers))
            if name in self.draft_states:
                self._restore_draft_state(name)
            else:
                self.overlap = _overlap_on(self.plan, args.get("overlap", "auto"), name)
                self._plan_auto(None, args["budget"], args["depth"], args.get("progress", False),
                                args.get("plan_tokens"))
        except BaseException as exc:  # (CUDA's out of memory is a RuntimeError; a profile unreadable, an
            # OSError; Ctrl-C too: the old draft back before it goes on up)
            reason = str(exc).replace("\n", " ")[:300] or type(exc).__name__
            self.switch_failed.add(name)  # (not tried again in this run: what failed once would again)
            self.steps_with_draft = 0
            self._free_draft()
            try:  # the old one back, as it was
                self.draft = self._build_draft(old)[0]
            except BaseException as again:  # (a consistent engine without a draft: plain decoding)
                self.draft_states.pop(old, None)
                self.draft, self.draft_name, self.draft_key = None, None, None
                self.auto_plans, self.planners, self.learned_paths = {}, {}, {}
                self.draft_choice.chosen = "none"
                for interrupt in (again, exc):
                    if not isinstance(interrupt, Exception):
                        raise interrupt from None
                raise UserError(f"cannot switch the draft to {name} ({reason}), nor load {old} again "
                                f"({str(again)[:300]}); going on without a draft") from None
            self._restore_draft_state(old)
            if not isinstance(exc, Exception):
                raise exc from None
            raise UserError(f"cannot switch the draft to {name} ({reason}); keeping {old}") from None
        self.draft_choice.chosen = name
        self.draft_choice.plan_for = self.plan_for
        self.steps_with_draft = 0
        record = {"from": old, "to": name, "seconds": time.perf_counter() - t0, "why": why}
        self.draft_switches.append(record)
        return record

    def _free_draft(self) -> None:
        """The current draft's model and K/V gone (its memory back before another is built)."""
        import gc
        if self.prefix_cache is not None:
            self.prefix_cache.drop(self.draft)  # (a substitute draft has none of its own, but levels)
        self.draft = None
        gc.collect()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore_draft_state(self, name: str) -> None:
        state = self.draft_states.pop(name)
        self.draft_key, self.auto_plans, self.planners = state["model_key"], state["auto_plans"], state["planners"]
        self.learned_paths, self.overlap = state["learned_paths"], state["overlap"]
        self.speed_check = state["speed_check"]
        self.step_check = state["step_check"]
        self.draft_name = state["display"]

    def _consider_switch(self, planner, temperature: float, budget: int) -> dict | None:
        """After an answer (--draft auto, adapting): switch drafts when what this run measured of
        the current one says another candidate wins (`draft_choice.switch_target`). Each switch
        doubles the steps the next one waits for (`switch_wait`), so that answers at temperatures
        that favour different drafts do not make it switch back and forth for long; a draft whose
        switch failed is not tried again. Errors go up to `after_answer`, which makes each one line."""
        from .planning.adaptive import expected_length
        from .planning.draft_choice import adapted_speedup, switch_target, switch_wait
        length = expected_length(planner.ended, 0, max(1, budget - 1))
        current = adapted_speedup(planner, length)
        kept = {name: adapted_speedup(st["planners"][k], length) for name, st in self.draft_states.items()
                for k in st["planners"] if abs(k - round(temperature, 3)) < 1e-9}
        mine = self.draft_choice.chosen
        target = switch_target(self.draft_choice, mine, current, temperature,
                               None if length is None else length + 1, self.steps_with_draft, kept,
                               min_steps=switch_wait(len(self.draft_switches)), exclude=self.switch_failed)
        if target is None:
            return None
        name, predicted = target
        why = (f"{mine} measured {current:.2f}x over plain on this run's answers; "
               f"{name} {'measured' if name in kept else 'is predicted'} {predicted:.2f}x")
        if self._load_args.get("progress", False):
            print(f"sequoia-offload: draft auto: switching from {mine} to {name} ({why})", file=sys.stderr)
        record = self.switch_draft(name, why)  # (a failure: `after_answer` says it; the old draft is back)
        if self._load_args.get("progress", False):
            print(f"sequoia-offload: draft auto: {name} loaded in {record['seconds']:.1f} s", file=sys.stderr)
        return record

    def forget_prefix(self) -> None:
        """Drop the cached K/V of the last conversation (the next prompt is prefilled whole)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def close(self) -> None:
        """Stop the layer loader and release the disk reader (also done when the engine is
        garbage-collected and at interpreter exit)."""
        self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prompt_ids(self, prompt: str | None = None, input_ids: list[int] | None = None,
                   messages: list[dict] | None = None) -> list[int]:
        """Exactly one of a text prompt, token ids, or chat messages -> token ids."""
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise UserError("give exactly one of prompt=, input_ids= or messages=")
        if messages is not None:
            if not messages:
                raise UserError("messages is empty")
            ids = self.tokenizer.encode_chat(messages)
        elif prompt is not None:
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in input_ids]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise UserError(f"input_ids contains {bad[0]}, outside the vocabulary (0..{self.config.vocab_size - 1})")
        if not ids:
            raise UserError("the prompt is empty (no tokens)")
        if len(ids) >= self.max_context:
            raise UserError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context} "
                            "(--max-context)")
        return ids

    def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                 messages: list[dict] | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: list[str] | str | None = None, on_token: OnToken | None = None,
                 cancel: threading.Event | None = None, suffix_key: object = None,
                 plain: bool = False, switch: bool = True) -> GenerationResult:
        """Generate up to max_new_tokens after the prompt (speculating when a draft is loaded).
        on_token(token_id, text) is called for every new token with the text it makes safe to
        show (possibly ''); the result's text excludes a matched stop string. The K/V of the
        longest prefix shared with the previous generation's tokens is reused (`prefix_cache`).
        Setting `cancel` from another thread stops the generation at the next layer boundary
        with GenerationCancelled. With suffix drafts, `suffix_key` names the store of earlier
        requests this one drafts from and adds to (the server keeps one per API key, or per
        conversation without keys, so that one client's text does not speed up another's).
        `plain`: decode without the draft or suffix drafts (plain streamed decoding of this
        engine's target, the yardstick a speed-up is measured against; `demo` uses it).
        `switch` (--draft auto): consider another draft once the answer is decoded, before
        returning (its record in `stats["draft_switch"]`); False leaves that to `after_answer`,
        for callers that hand the answer out first (the server, `chat`)."""
        try:
            params = SamplingParams(temperature, top_p, top_k)
        except ValueError as e:
            raise UserError(str(e)) from None
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = self.prompt_ids(prompt, input_ids, messages)
        generator = torch.Generator()  # sampling and verification run on the CPU copies of the logits
        if seed is not None and not 0 <= seed < 2**63:
            raise UserError(f"seed must be in 0..2**63-1, got {seed}")
        generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        self._switch_due = None
        if cancel is None:
            result = self._decode(ids, max_new_tokens, params, generator, stop, on_token, suffix_key, plain)
        else:
            models = [m for m in (self.model, self.draft) if m is not None]
            for m in models:
                m.interrupt = cancel
            try:
                result = self._decode(ids, max_new_tokens, params, generator, stop, on_token, suffix_key, plain)
            finally:
                for m in models:
                    m.interrupt = None
        # another draft, where this run says it wins: for the next answer, once this one's decoder,
        # caches and interrupt are gone (the answer's own time does not include it)
        if switch:
            result.stats["draft_switch"] = self.after_answer()
        return result

    def after_answer(self) -> dict | None:
        """--draft auto: after an answer decoded with `generate(switch=False)` and handed out,
        switch drafts where this run says another wins (`_consider_switch`); the switch's record,
        or None. Nothing to do otherwise (any engine may call it)."""
        due, self._switch_due = self._switch_due, None
        if due is None:
            return None
        try:
            return self._consider_switch(*due)
        except UserError as exc:  # (`switch_draft`'s: what failed, and what the engine goes on with)
            print(f"sequoia-offload: {exc}", file=sys.stderr)
        except Exception as exc:  # (the answer is out: a failure here costs the switch, not the answer)
            print(f"sequoia-offload: draft auto: no switch ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None

    def _decode(self, ids: list[int], max_new_tokens: int, params: SamplingParams,
                generator: torch.Generator, stop: list[str] | str | None, on_token: OnToken | None,
                suffix_key: object = None, plain: bool = False) -> GenerationResult:
        """One loop for every mode: plain decoding is a one-node tree without a draft."""
        budget = min(max_new_tokens, self.max_context - len(ids))
        draft = None if plain else self.draft
        spec = self.tree if draft is not None else TreeSpec()
        source = "generic" if spec.acceptance == GENERIC_ACCEPTANCE else "given"
        auto = planner = None
        if self.auto_plans and draft is not None:
            auto, planner = self._planner(params)
            # (the first token comes from the prefill: the steps make the rest)
            spec, source = planner.begin(max(1, budget - 1)), auto.source
        elif spec.kind == "sequoia" and self.stored_acceptance:
            vector, path, t = nearest(self.stored_acceptance, params.temperature)
            spec, source = replace(spec, acceptance=vector), f"{path.name} (measured at T={t:g})"
        if self.prefix_cache is not None:
            self.prefix_cache.select(self.model, ids)
        # (--tree none, or auto choosing plain decoding: the draft sits the steps out; with adaptation
        # its cache is kept and catches up before its next tree)
        adaptive = planner is not None and planner.adapt and planner.max_nodes > 1
        drafter = gate = None
        if self.suffix_store is not None and not plain:
            drafter = SuffixDrafter(ids, self.suffix_store.snapshot(suffix_key), MAX_PATTERN + 1)
            if self.suffix_gated:  # (per request temperature, as the planners are)
                from .planning.adaptive import SuffixGate
                gate = self.gates.setdefault(round(params.temperature, 3), SuffixGate())
                gate_start = (gate.runs, gate.skips)
        choose = planner.choose_arm if planner is not None and drafter is not None else gate.choose if gate else None
        overlap_gate = None
        if self.overlap and draft is not None and self.overlap_gated:  # (its decoder's steps are timed)
            from .planning.adaptive import OverlapGate
            overlap_gate = self.overlap_gates.setdefault((self.draft_key, round(params.temperature, 3)), OverlapGate())
            overlap_start = overlap_gate.counts()
        decoder = SpeculativeDecoder(self.model, draft, spec, params, generator, len(ids) + budget,
                                     self.prefix_cache, max_nodes=planner.max_nodes if adaptive else None,
                                     timed=adaptive or overlap_gate is not None, suffix=drafter, choose=choose,
                                     overlap=self.overlap and draft is not None, ahead_gate=overlap_gate)
        stream = TextStream(self.tokenizer.decode, stop)
        before = self.model.layers.snapshot()
        start = time.perf_counter()
        token = decoder.first_token(decoder.prefill(ids, self.max_batch_tokens))
        prefill_s = time.perf_counter() - start
        new: list[int] = []
        ranks = (planner.candidates.acceptance.width if planner is not None
                 else spec.acceptance.width if spec.kind == "sequoia" else spec.max_nodes)
        steps, by_rank = 0, [0] * max(1, ranks)
        # the hazard of each rank, from every accepted path's nodes (static trees' steps)
        evidence = RankEvidence(max(1, ranks))
        # steps by the number of tree nodes they accepted (0 .. depth-1)
        by_length = [0] * (planner.max_depth if adaptive else spec.depth)
        pending = [token]
        split = dict.fromkeys(("draft_before_pass", "draft_overlapped", "target_pass", "rest"), 0.0)
        ahead_levels = 0
        step_seconds: list[float] = []  # each step's wall time, its text's output included
        while True:
            t_emit = time.perf_counter()
            done, eos = self._emit(pending, new, stream, budget, on_token)
            t_emit = time.perf_counter() - t_emit  # text out: part of a step's cost as the user sees it
            if step_seconds:
                step_seconds[-1] += t_emit
            if done:
                break
            step = decoder.step(new[-1])
            steps += 1
            lt = decoder.last_times
            step_seconds.append(lt.total)
            for key, value in (("draft_before_pass", lt.draft), ("draft_overlapped", lt.ahead),
                               ("target_pass", lt.target - lt.ahead), ("rest", lt.rest)):
                split[key] += value
            ahead_levels += lt.ahead_levels
            for rank in step.verify.accepted_ranks:
                by_rank[min(rank, len(by_rank) - 1)] += 1
            verified = decoder.last_model_verify
            if decoder.parents is not None and len(decoder.parents) > 1 and verified is not None \
                    and decoder.last_arm != "suffix":  # (a static tree's step that ran the draft's nodes)
                evidence.observe_step(decoder.parents, verified.accepted, verified.accepted_ranks)
            by_length[min(len(step.verify.accepted), len(by_length) - 1)] += 1
            pending = step.tokens
            if gate is not None:
                gate.observe(decoder.last_proposal, decoder.last_nodes,
                             decoder.last_times.total + t_emit, step.tokens)
            if planner is not None:  # the next step's tree, from this step and the ones before
                times = replace(decoder.last_times, total=decoder.last_times.total + t_emit)
                if decoder.last_proposal is not None and decoder.last_proposal.size > 1:
                    planner.observe_suffix(decoder.last_proposal, step.tokens)
                nxt = planner.record(decoder.spec, decoder.last_model_verify, times, steps == 1,
                                     arm=decoder.last_arm, tokens=self._emitted(step.tokens, len(new), budget))
                if nxt is not None:
                    decoder.set_spec(nxt)
        finish = "stop" if eos or stream.stopped else "length"
        if planner is not None:  # (an answer that ended on its own tells the planner how long answers are)
            planner.finish(len(new) - 1, finish == "stop")
        seconds = time.perf_counter() - start
        suffix_stats = None
        if drafter is not None:  # this request's new text joins its key's store
            self.suffix_store.add(suffix_key, ids, new)
            suffix_stats = {**drafter.stats(), "accepted_tokens": decoder.suffix_accepted,
                            "store_total_tokens": self.suffix_store.tokens, **(gate.stats(*gate_start) if gate else {})}
        stats = {"prompt_tokens": len(ids), "cached_prompt_tokens": decoder.reused_tokens,
                 "prefilled_tokens": len(ids) - decoder.reused_tokens, "new_tokens": len(new), "seconds": seconds,
                 "prefill_seconds": prefill_s, "tokens_per_second": len(new) / seconds,
                 "decode_tokens_per_second": (len(new) - 1) / max(seconds - prefill_s, 1e-9),
                 "finish_reason": finish, "tree": _tree_name(spec, draft, drafter),
                 "tree_budget": spec.max_nodes, "tree_depth": spec.depth, "suffix": suffix_stats,
                 "target_steps": steps, "tokens_per_step": (len(new) - 1) / steps if steps else 0.0,
                 "step_seconds": step_seconds,
                 "acceptance_by_rank": by_rank, "rank_evidence": evidence.as_dict(), "accepted_lengths": by_length,
                 "acceptance_source": source if spec.kind == "sequoia" else None,
                 "auto": None if auto is None else _auto_stats(auto, planner, self.speed_check, len(new) - 1,
                                                                 self.step_check),
                 # seconds of the steps' parts (the target's pass without the draft work done in it)
                 "step_split": split,
                 "overlap": None if not decoder.overlap else {
                     "hits": decoder.ahead_hits, "misses": decoder.ahead_misses, "levels_used": ahead_levels,
                     **(overlap_gate.stats(overlap_start) if overlap_gate is not None else {})},
                 **self.model.layers.snapshot().minus(before).as_dict()}
        if planner is not None and self.remember and planner.adapt and auto.temperature in self.learned_paths:
            self._keep_learned(planner, auto.temperature)  # (after the answer's time is taken)
        if planner is not None and planner.adapt and self.draft_choice is not None and self.suffix_store is None:
            self.steps_with_draft += steps
            stats["draft_switch"] = None  # (`generate` considers another draft after this returns)
            self._switch_due = (planner, params.temperature, budget)
        return GenerationResult(stream.text, new, finish, stats)

    def _keep_learned(self, planner, temperature: float) -> None:
        """Write what `planner` learned for the next run (`planning.learned`). A cache that cannot
        be written costs the next run its head start, not this answer: one line, no error. (Planners
        of request temperatures that share a plan write one file: the last one's state is kept.)"""
        from .planning import learned
        path, prior = self.learned_paths[temperature]
        try:
            learned.save(path, prior, planner)
        except OSError as exc:
            if not self._learned_warned:
                self._learned_warned = True
                print(f"sequoia-offload: cannot keep what the planner learned in {path} ({exc}); "
                      "the next run starts from the stored vectors", file=sys.stderr)

    def plan_for(self, temperature: float, greedy: bool | None = None):
        """The auto plan a request at `temperature` starts from: the nearest vector's of the same
        kind (greedy or sampled) where the engine has one (what the first lines print)."""
        greedy = temperature == 0 if greedy is None else greedy
        temps = [k for k in self.auto_plans if (k == 0) == greedy] or list(self.auto_plans)
        return self.auto_plans[min(temps, key=lambda k: (abs(k - temperature), k))]

    def _planner(self, params: SamplingParams):
        """(AutoPlan, OnlinePlanner) for a request's temperature: the plan of the nearest vector
        of the same kind (greedy or sampled, where the engine has one), and a planner of this
        temperature's own, made from that plan on first use."""
        from .planning.adaptive import OnlinePlanner
        plan = self.plan_for(params.temperature, params.greedy)
        key = round(params.temperature, 3)
        if key not in self.planners:
            self.planners[key] = OnlinePlanner(plan.vector, plan.timings, plan.candidates, self.adapt, plan.choice)
            if plan.learned is not None:  # (an earlier run's estimate and lengths: `planning.learned`)
                self.planners[key].restore(plan.learned)
        planner = self.planners[key]
        planner.step_error, planner.spell = plan.step_error, plan.spell
        planner.adapt = self.adapt
        planner.first_checks = self.first_plain_checks
        return plan, planner

    def _emitted(self, tokens: list[int], done: int, budget: int) -> int:
        """Of a step's tokens, how many will be handed out after `done` tokens: up to the budget
        and the first end-of-sequence token (a stop string is not foreseen here)."""
        k = min(len(tokens), max(0, budget - done))
        eos = next((i for i, t in enumerate(tokens[:k]) if t in self.eos_token_ids), None)
        return k if eos is None else eos + 1

    def _emit(self, tokens: list[int], new: list[int], stream: TextStream, budget: int,
              on_token: OnToken | None) -> tuple[bool, bool]:
        """Hand out tokens in order until an end-of-sequence token, a stop string or the budget."""
        for token in tokens:
            new.append(token)
            eos = token in self.eos_token_ids
            text = "" if eos else stream.push(token)
            done = eos or stream.stopped or len(new) >= budget
            if done:
                text += stream.finish()
            if on_token is not None:
                on_token(token, text)
            if done:
                return True, eos
        return False, False


def _tree_name(spec: TreeSpec, draft, drafter) -> str:
    if drafter is None:
        return spec.kind
    return "suffix" if draft is None else f"{spec.kind}+suffix"


def _auto_stats(auto, planner, check=None, made: int | None = None, step_check=None) -> dict:
    """`stats["auto"]`: the tree the generation started with and what was predicted for it then
    (from the profile, or from what earlier generations taught the planner), the trees its steps
    used, the per-step forecast, plain decoding's predicted time as the steps measured it, and
    the load's speed check of the profile (`profiler.SpeedCheck`; None: a profile measured then)
    and its step check (`profiler.StepCheck`; None: not run).
    `made`: the tokens the steps made (the prefill's first not counted); an answer that ended
    sooner than planned gets the start's prediction for its own length too (`predicted_for_made`)."""
    start, log, best = planner.log.start, planner.log, auto.best_tree
    spread = log.start_spread  # (the middle 80% of what answers of the planned length measure)
    for_made = None
    if made is not None and made > 0 and start.length is not None and made < start.length:
        at = planner.start_for(made)
        if at is not None:
            c, made_spread = at
            for_made = {"tokens": made + 1, "seconds_per_token": c.seconds_per_token,
                        "speedup": log.start_plain_seconds / c.seconds_per_token,
                        "speedup_range": None if made_spread is None else list(made_spread)}
    return {"temperature": auto.temperature, "budget": start.budget, "depth": start.depth, "adapt": planner.adapt,
            "predicted_tokens_per_step": start.tokens_per_step,
            "predicted_seconds_per_token": start.seconds_per_token,
            "predicted_plain_seconds_per_token": planner.log.start_plain_seconds,
            "predicted_speedup": planner.log.start_plain_seconds / start.seconds_per_token,
            "predicted_speedup_range": None if spread is None else list(spread),
            "predicted_for_tokens": None if start.length is None else start.length + 1,
            "predicted_for_made": for_made,
            "best_tree": [best.budget, best.depth], "best_tree_predicted_seconds_per_token": best.seconds_per_token,
            "adapted_plain_seconds_per_token": planner.predicted_plain(),
            "speed_check": None if check is None else check.as_dict(),
            "step_check": None if step_check is None else step_check.as_dict(), **log.as_dict()}

