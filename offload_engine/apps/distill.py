"""Distil a small Llama-family draft for any target (`sequoia-offload distill`).

1. **On-policy text.** The target answers a prompt list (its own chat template; half of the
   prompts greedily, half sampled at temperature 0.8), in left-padded batches with a KV cache.
   A draft learns to predict *the target's* answers, which is what it will be asked to do.
   Optional extra text (`--data`) is cut into windows and added.
2. **The student.** Same tokenizer and vocabulary, `--layers` decoder layers. When its hidden
   size equals the target's, it starts as a copy of the target's embeddings, final norm and
   first `--layers` decoder layers (an early exit of the target: measured on SmolLM2-135M with
   3 layers, layers 0-2 agreed with the target's top-1 on 7% of its answers before training,
   layers 0, 14, 29 on 0.1%), and the embeddings (tied head) stay frozen: the draft can later
   share them with the target. `--init-layers` picks other layers.
   Otherwise it starts random (std 0.02) and trains everything.
3. **Training.** KL(target || draft) of the temperature-1 next-token distributions at every
   answer position, the target's logits computed on the fly; AdamW, linear warm-up then cosine
   decay over `--tokens` training positions. Held-out sequences (never trained on) give the
   progress bar's top-1 agreement, logged as the learning curve.
4. **Interruptions.** Everything lives in `<out>.partial/` (generated text, weights, optimizer
   state, progress) and is saved atomically every `save_every` steps and on Ctrl-C; `--resume`
   continues from the last save with the same result as an uninterrupted run. The finished
   Hugging Face folder is written to a temporary name and renamed to `<out>` at the very end, so
   an interrupted run never leaves a folder that loads as a draft.

Weights are read from safetensors only and written as safetensors; state files are JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import UserError
from ..formats.checkpoint import layer_shapes, open_checkpoint
from ..formats.config import ModelConfig, load_config, parse_dtype, read_json_object
from ..formats.tokenizer import Tokenizer
from ..fsutil import atomic_write_text, fsync_path, fsync_tree, remove_stale_temps
from ..runtime.kv_cache import KVCache
from ..runtime.model import Rope, decoder_layer, rms_norm, rope_inv_freq
from ..speculation.drafts import EMBED, TOKENIZER_FILES
from ..speculation.measure import DEFAULT_PROMPTS, read_prompts


@dataclass
class DistillOptions:
    layers: int = 3
    hidden: int | None = None  # default: the target's (then layers and embeddings start as the target's)
    tokens: int = 200_000  # training positions in all (epochs over the generated text as needed)
    gen_tokens: int | None = None  # stop generating answers after this many (default: tokens // 2)
    max_answer_tokens: int = 192
    data: str | None = None  # extra plain text file
    prompts: str | None = None  # prompt list (default: the shipped distill_prompts.jsonl)
    init_layers: tuple[int, ...] | None = None  # which target layers to copy (default: the first ones)
    seed: int = 0
    lr: float = 3e-4
    batch_size: int = 8  # sequences per step
    gen_batch: int = 16  # prompts answered together
    val_sequences: int = 32  # held-out sequences for the agreement figure
    eval_every: int = 30  # steps
    save_every: int = 25  # steps
    save_dtype: str = "bfloat16"
    device: str = "cpu"
    offload: str = "auto"  # where the teacher's layers live (the engine's placement flags)
    vram: str | None = None
    ram: str | None = None


@dataclass
class Progress:
    step: int = 0
    tokens_seen: int = 0
    # held-out "kl" and top-1 "agreement" after "tokens" training positions; "train_kl": the mean
    # training loss since the previous entry
    curve: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    interval_loss: float = 0.0  # summed training loss since the last curve entry
    interval_positions: int = 0


# ---- batched forward passes (training and batched generation) ------------------------------------

class _NoCache:
    """Attention over the new tokens only (training: the whole sequence is one pass)."""
    length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return k, v


def batch_hidden(cfg: ModelConfig, embed: torch.Tensor, norm: torch.Tensor, layers, ids: torch.Tensor,
                 positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
    """Final-normed hidden states [B, S, H] of ids [B, S]; the same layer math as the engine."""
    inv_freq = rope_inv_freq(cfg).to(ids.device)
    rope = Rope.at(inv_freq, positions, embed.dtype)
    x = F.embedding(ids, embed)
    cache = cache if cache is not None else _NoCache()
    for i, w in enumerate(layers):
        x = decoder_layer(w, x, rope, cache, i, mask, cfg)
    return rms_norm(x, norm, cfg.rms_norm_eps)


class _Model:
    """Weights of a model as plain tensors: embeddings (tied or separate head), norm, layers."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], layers=None):
        self.cfg = cfg
        self.tensors = tensors
        # any re-iterable of per-layer weights: a list, or the target's LayerExecutor when it streams
        self.layers = layers if layers is not None else [
            {k[len(f"model.layers.{i}."):]: v for k, v in tensors.items() if k.startswith(f"model.layers.{i}.")}
            for i in range(cfg.num_layers)]

    @property
    def head(self) -> torch.Tensor:
        return self.tensors[EMBED] if self.cfg.tie_word_embeddings else self.tensors["lm_head.weight"]

    def hidden(self, ids, positions, mask, cache=None) -> torch.Tensor:
        return batch_hidden(self.cfg, self.tensors[EMBED], self.tensors["model.norm.weight"], self.layers, ids,
                            positions, mask, cache)


def _training_bytes(t: ModelConfig, student_raw: dict, opts: "DistillOptions") -> int:
    """Device bytes training needs besides the teacher (an estimate erring high): the student in
    fp32 with gradients and two Adam moments, the generation batch's KV cache, and the fp32
    logits of a step (teacher log-probs, student logits, their softmax and gradients)."""
    h = student_raw.get("hidden_size", t.hidden_size)
    f = student_raw.get("intermediate_size", t.intermediate_size)
    kvh = student_raw.get("num_key_value_heads", t.num_kv_heads)
    per_layer = 2 * h * h + 2 * h * kvh * t.head_dim + 3 * h * f
    params = opts.layers * per_layer + t.vocab_size * h
    positions = opts.batch_size * (opts.max_answer_tokens + 256)  # answers plus their prompts
    kv = 2 * t.num_layers * opts.gen_batch * t.num_kv_heads * t.head_dim * (opts.max_answer_tokens + 512) * 4
    return 16 * params + kv + 5 * positions * t.vocab_size * 4


def load_teacher(target_dir: Path, opts: "DistillOptions", progress: bool = True, reserve_bytes: int = 0):
    """The target as the engine places it (`--offload`, `--vram`, `--ram`): resident when it fits,
    else its layers stream, so a target larger than the device can still teach (each batch is
    one streamed pass). `reserve_bytes` of the device budget are left for training. Returns
    (model, engine); keep the engine open while the model is used."""
    from ..engine import Engine, resolve_device
    from ..runtime.placement import default_budgets, fmt_bytes, parse_size
    vram = opts.vram
    if reserve_bytes:
        budget = parse_size(vram) if vram is not None else default_budgets(resolve_device(opts.device))[0]
        if budget <= reserve_bytes:
            raise UserError(f"training needs about {fmt_bytes(reserve_bytes)} on {opts.device} besides the "
                            f"target, more than the {fmt_bytes(budget)} available (--vram); lower --batch-size "
                            "or use a smaller --hidden/--layers")
        vram = budget - reserve_bytes
    engine = Engine.load(target_dir, device=opts.device, offload=opts.offload, vram=vram, ram=opts.ram,
                         progress=progress)
    m = engine.model
    tensors = {EMBED: m.embed, "model.norm.weight": m.norm}
    if not m.cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = m.lm_head
    return _Model(m.cfg, tensors, m.layers), engine


# ---- 1. on-policy text ---------------------------------------------------------------------------

@torch.no_grad()
def generate_batch(target: _Model, prompts: list[list[int]], max_new: int, temperatures: list[float],
                   eos: set[int], generator: torch.Generator) -> list[list[int]]:
    """Answers of the target to a batch of prompts (left-padded), each stopping at an EOS id."""
    dev = target.tensors[EMBED].device
    B, P = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, device=dev)
    cols = torch.arange(P + max_new, device=dev)
    valid = cols[None, :] >= pad[:, None]  # [B, T]: key slots that hold real tokens
    rows = torch.arange(P, device=dev)
    # padding queries see themselves only, so that no row of the mask is empty (NaN-free K/V)
    mask = ((cols[None, :P] <= rows[:, None]) & valid[:, None, :P]) | (cols[None, :P] == rows[:, None])
    positions = (rows[None, :] - pad[:, None]).clamp_min(0)
    cfg = target.cfg
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, P + max_new, target.tensors[EMBED].dtype, dev,
                    batch=B)
    temps = torch.tensor(temperatures, dtype=torch.float32)
    answers: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    h = target.hidden(ids, positions, mask, cache)[:, -1]
    cache.advance(P)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    for step in range(max_new):
        logits = F.linear(h, target.head).float().cpu()  # [B, V]
        greedy = logits.argmax(-1)
        probs = torch.softmax(logits / temps.clamp_min(1e-6)[:, None], -1)
        sampled = torch.multinomial(probs, 1, generator=generator)[:, 0]
        token = torch.where(temps > 0, sampled, greedy)
        for b in range(B):
            if not done[b]:
                answers[b].append(int(token[b]))
                done[b] = int(token[b]) in eos
        if bool(done.all()) or step == max_new - 1:
            break
        T = cache.length + 1
        h = target.hidden(token[:, None].to(dev), (lengths + step)[:, None], valid[:, None, :T], cache)[:, 0]
        cache.advance(1)
    return answers


def _text_windows(path: Path, tokenizer: Tokenizer, window: int) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--data {path}: cannot read ({e})") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise UserError(f"--data {path}: fewer than 2 tokens of text")
    return [{"ids": ids[i:i + window], "start": 0} for i in range(0, len(ids) - 1, window)
            if len(ids[i:i + window]) >= 2]


# ---- state files ---------------------------------------------------------------------------------

def _atomic_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj))


def _atomic_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def _make_work_dir(work: Path, options: dict) -> None:
    """The work folder with its options.json, renamed into place whole: a folder that `--resume`
    cannot read (killed between its mkdir and its options) never exists."""
    work.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(work.parent, f".{work.name}.tmp-*")
    tmp = work.with_name(f".{work.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _atomic_json(tmp / "options.json", options)
    fsync_tree(tmp)
    os.rename(tmp, work)
    fsync_path(work.parent)


# ---- 2. the student ------------------------------------------------------------------------------

def student_config(raw: dict, cfg: ModelConfig, layers: int, hidden: int | None) -> dict:
    """The draft's config.json: the target's, with fewer layers (and a smaller width if asked)."""
    out = {k: v for k, v in raw.items() if k not in ("quantization_config", "layer_types", "torch_dtype", "dtype")}
    out["architectures"] = ["LlamaForCausalLM"]
    out["model_type"] = "llama"
    out["num_hidden_layers"] = layers
    if hidden is not None and hidden != cfg.hidden_size:
        head_dim = cfg.head_dim
        if hidden % head_dim:
            raise UserError(f"--hidden {hidden} must be a multiple of the target's head size {head_dim}")
        heads = hidden // head_dim
        kv = math.gcd(heads, cfg.num_kv_heads)
        out.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                   intermediate_size=int(math.ceil(hidden * 8 / 3 / 64) * 64), head_dim=head_dim)
    return out


def init_student(target: _Model, target_dir: Path, cfg: ModelConfig, init_layers: tuple[int, ...] | None,
                 generator: torch.Generator) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Initial fp32 weights and the names that train."""
    t = target.cfg
    same = cfg.hidden_size == t.hidden_size
    tensors: dict[str, torch.Tensor] = {}
    dev = target.tensors[EMBED].device
    if same:
        picks = init_layers or tuple(range(cfg.num_layers))
        ckpt = open_checkpoint(target_dir, t)
        try:
            for n, src in enumerate(picks):  # from the checkpoint: a streamed target is not indexable
                for name, w in ckpt.load_layer(src, torch.float32, dev).items():
                    tensors[f"model.layers.{n}.{name}"] = w
        finally:
            ckpt.close()
        tensors[EMBED] = target.tensors[EMBED].detach().float().clone()
        tensors["model.norm.weight"] = target.tensors["model.norm.weight"].detach().float().clone()
        if not cfg.tie_word_embeddings:
            tensors["lm_head.weight"] = target.tensors["lm_head.weight"].detach().float().clone()
        frozen = {EMBED, "lm_head.weight"}
    else:
        for n in range(cfg.num_layers):
            for name, shape in layer_shapes(cfg).items():
                if len(shape) == 1:
                    w = torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)
                else:
                    w = torch.randn(shape, generator=generator) * 0.02
                tensors[f"model.layers.{n}.{name}"] = w.to(dev)
        tensors[EMBED] = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02).to(dev)
        tensors["model.norm.weight"] = torch.ones(cfg.hidden_size, device=dev)
        if not cfg.tie_word_embeddings:
            tensors["lm_head.weight"] = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator)
                                         * 0.02).to(dev)
        frozen = set()
    return tensors, {n for n in tensors if n not in frozen}


# ---- 3. training ---------------------------------------------------------------------------------

def _batch(records: list[dict], dev: torch.device):
    """Right-padded ids [B, S], and the flat indices of the positions that predict a trained token."""
    S = max(len(r["ids"]) for r in records)
    ids = torch.zeros(len(records), S, dtype=torch.long)
    where = []
    for b, r in enumerate(records):
        ids[b, :len(r["ids"])] = torch.tensor(r["ids"])
        where.extend(b * S + p for p in range(r["start"], len(r["ids"]) - 1))
    labels_at = torch.tensor(where, dtype=torch.long)
    return ids.to(dev), labels_at.to(dev), S


def _pair_logits(target: _Model, student: _Model, records: list[dict], dev: torch.device):
    ids, at, S = _batch(records, dev)
    B = ids.shape[0]
    positions = torch.arange(S, device=dev).expand(B, S)
    mask = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    with torch.no_grad():
        th = target.hidden(ids, positions, mask).reshape(B * S, -1)[at]
        t_logp = torch.log_softmax(F.linear(th, target.head).float(), -1)
    sh = student.hidden(ids, positions, mask).reshape(B * S, -1)[at]
    s_logits = F.linear(sh, student.head).float()
    return t_logp, s_logits


def kl_loss(t_logp: torch.Tensor, s_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(target || draft) at temperature 1."""
    s_logp = torch.log_softmax(s_logits, -1)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


@torch.no_grad()
def evaluate(target: _Model, student: _Model, records: list[dict], dev: torch.device,
             batch_size: int) -> tuple[float, float]:
    """(mean KL, top-1 agreement) over every trained position of `records`."""
    kl_sum, agree, n = 0.0, 0, 0
    for i in range(0, len(records), batch_size):
        t_logp, s_logits = _pair_logits(target, student, records[i:i + batch_size], dev)
        kl_sum += float(kl_loss(t_logp, s_logits)) * t_logp.shape[0]
        agree += int((t_logp.argmax(-1) == s_logits.argmax(-1)).sum())
        n += t_logp.shape[0]
    return kl_sum / max(n, 1), agree / max(n, 1)


def _lr(opts: DistillOptions, tokens_seen: int) -> float:
    frac = min(tokens_seen / max(opts.tokens, 1), 1.0)
    warm = 0.05
    if frac < warm:
        return opts.lr * max(frac / warm, 0.02)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (frac - warm) / (1 - warm))))


def _epoch_batches(n: int, batch_size: int, seed: int, epoch: int, lengths: list[int]) -> list[list[int]]:
    """A seeded shuffle; within windows of 8 batches sequences are sorted by length (less padding)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    span = batch_size * 8
    out = []
    for i in range(0, n, span):
        chunk = sorted(order[i:i + span], key=lambda j: lengths[j])
        out.extend(chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size))
    perm = torch.randperm(len(out), generator=g).tolist()
    return [out[p] for p in perm]


# ---- the command ---------------------------------------------------------------------------------

def work_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _finished_from(out: Path, work: Path) -> bool:
    """Whether `out` is the student that `work`'s run finished: its distill.json (written last,
    inside the folder renamed into place) names the same target and options."""
    try:
        report = json.loads((out / "distill.json").read_text())
        saved = json.loads((work / "options.json").read_text())
        placement = ("device", "offload", "vram", "ram")  # a resumed run may place itself anew
        same = [{k: v for k, v in o.items() if k not in placement} for o in (report["options"], saved["options"])]
        return report["target"] == saved["target"] and same[0] == same[1]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def distill(target_dir: str | Path, out: str | Path, opts: DistillOptions, *, resume: bool = False,
            progress: bool = True, stop_after_steps: int | None = None) -> Path | None:
    """Run (or resume) a distillation; returns the finished folder, or None when stopped early by
    `stop_after_steps` (tests use it to interrupt a run at a known step)."""
    from ..engine import resolve_target
    out = Path(out)
    work = work_dir(out)
    if out.exists() and any(out.iterdir()):
        if resume and work.exists() and _finished_from(out, work):  # killed after its folder was renamed
            shutil.rmtree(work)  # into place, before the work folder went
            return out
        raise UserError(f"{out} exists and is not empty; choose another --out")
    if work.exists() and not resume:
        raise UserError(f"{work} holds an interrupted run: pass --resume to continue it, or delete it")
    if resume and not work.exists():
        raise UserError(f"--resume: no interrupted run at {work}")
    if opts.layers < 1:
        raise UserError(f"--layers must be >= 1, got {opts.layers}")
    dev = torch.device(opts.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    target_dir = resolve_target(target_dir, progress)
    tcfg = load_config(target_dir)
    raw = read_json_object(target_dir / "config.json")
    tokenizer = Tokenizer.from_folder(target_dir)
    opts_path = work / "options.json"
    if resume:
        try:
            saved = json.loads(opts_path.read_text())
            placement = {"device": opts.device, "offload": opts.offload, "vram": opts.vram, "ram": opts.ram}
            opts = DistillOptions(**{**saved["options"], "init_layers": tuple(saved["options"]["init_layers"])
                                     if saved["options"]["init_layers"] else None, **placement})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--resume: {opts_path} is missing or damaged ({e}); delete {work} and start "
                            "again") from None
        if saved["target"] != str(target_dir):
            raise UserError(f"--resume: the interrupted run distils {saved['target']}, not {target_dir}")
    _check_options(opts, tcfg)
    scfg_raw = student_config(raw, tcfg, opts.layers, opts.hidden)
    target, engine = load_teacher(target_dir, opts, progress, _training_bytes(tcfg, scfg_raw, opts))
    try:
        if not resume:  # the work folder appears only once the teacher is in place, with its options
            _make_work_dir(work, {"target": str(target_dir), "options": asdict(opts)})
        return _run(target, target_dir, tcfg, raw, tokenizer, opts, out, work, dev, progress, stop_after_steps)
    finally:
        engine.close()


def _run(target: _Model, target_dir: Path, tcfg: ModelConfig, raw: dict, tokenizer: Tokenizer,
         opts: DistillOptions, out: Path, work: Path, dev: torch.device, progress: bool,
         stop_after_steps: int | None) -> Path | None:
    records = _on_policy_text(target, tokenizer, tcfg, opts, work, dev, progress)
    if opts.data:
        records = records + _text_windows(Path(opts.data), tokenizer, 256)
    val = [r for r in records if r.get("val")]
    train = [r for r in records if not r.get("val")]
    if not train:
        raise UserError("no training text: the prompt list gave no answers")

    scfg_raw = student_config(raw, tcfg, opts.layers, opts.hidden)
    scfg = _config_from_raw(scfg_raw, work)
    g = torch.Generator().manual_seed(opts.seed)
    tensors, trainable = init_student(target, target_dir, scfg, opts.init_layers, g)
    for n, w in tensors.items():
        w.requires_grad_(n in trainable)
    params = [tensors[n] for n in sorted(trainable)]
    optim = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = Progress()
    if (work / "state.safetensors").exists():  # a resumed run (a fresh one starts without a work folder)
        state = _load_state(work, tensors, sorted(trainable), optim)
    student = _Model(scfg, tensors)

    lengths = [len(r["ids"]) for r in train]
    bar = tqdm(total=opts.tokens, initial=min(state.tokens_seen, opts.tokens), desc="distilling", unit="tok",
               unit_scale=True, disable=None if progress else True)
    started = time.perf_counter() - state.seconds
    last_agree = state.curve[-1]["agreement"] if state.curve else float("nan")
    if not state.curve and val:
        kl, last_agree = evaluate(target, student, val, dev, opts.batch_size)
        state.curve.append({"tokens": 0, "step": 0, "kl": kl, "agreement": last_agree})
    epoch_order: dict[int, list[list[int]]] = {}  # the batches of the current epoch, made once
    with _deferred_interrupt() as interrupted:
        while state.tokens_seen < opts.tokens:
            if not epoch_order:
                epoch_order[0] = _epoch_batches(len(train), opts.batch_size, opts.seed, 0, lengths)
            epoch, k = divmod(state.step, len(epoch_order[0]))  # every epoch has as many batches
            if epoch not in epoch_order:
                epoch_order = {0: epoch_order[0],
                               epoch: _epoch_batches(len(train), opts.batch_size, opts.seed, epoch, lengths)}
            batch = [train[j] for j in epoch_order[epoch][k]]
            for group in optim.param_groups:
                group["lr"] = _lr(opts, state.tokens_seen)
            t_logp, s_logits = _pair_logits(target, student, batch, dev)
            loss = kl_loss(t_logp, s_logits)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            state.step += 1
            state.tokens_seen += t_logp.shape[0]
            state.interval_loss += float(loss.detach()) * t_logp.shape[0]
            state.interval_positions += t_logp.shape[0]
            bar.update(t_logp.shape[0])
            if val and (state.step % opts.eval_every == 0 or state.tokens_seen >= opts.tokens):
                kl, last_agree = evaluate(target, student, val, dev, opts.batch_size)
                state.curve.append({"tokens": state.tokens_seen, "step": state.step, "kl": kl,
                                    "agreement": last_agree,
                                    "train_kl": state.interval_loss / max(state.interval_positions, 1)})
                state.interval_loss, state.interval_positions = 0.0, 0
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", agree=f"{last_agree:.3f}")
            stop = interrupted() or (stop_after_steps is not None and state.step >= stop_after_steps)
            if state.step % opts.save_every == 0 or state.tokens_seen >= opts.tokens or stop:
                state.seconds = time.perf_counter() - started
                _save_state(work, tensors, sorted(trainable), optim, state)  # at a step boundary only
            if stop and state.tokens_seen < opts.tokens:
                bar.close()
                if interrupted():
                    raise KeyboardInterrupt
                return None
    bar.close()
    return _finish(out, work, target_dir, scfg_raw, tensors, opts, state, len(train), len(val))


@contextlib.contextmanager
def _deferred_interrupt():
    """Ctrl-C during a training step is noted and acted on at the step's end (after its save), so
    a save never holds half a step. Yields a callable: was Ctrl-C pressed? (In a thread other than
    the main one, signals cannot be caught: Ctrl-C then interrupts at once, between saves.)"""
    hit = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.signal(signal.SIGINT, lambda *_: hit.append(True))
    try:
        yield lambda: bool(hit)
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_options(opts: DistillOptions, t: ModelConfig) -> None:
    for name, value in (("--layers", opts.layers), ("--tokens", opts.tokens), ("--batch-size", opts.batch_size),
                        ("--hidden", opts.hidden if opts.hidden is not None else 1), ("--lr", opts.lr)):
        if not value > 0:
            raise UserError(f"{name} must be > 0, got {value}")
    picks = opts.init_layers
    if picks is None:
        if (opts.hidden is None or opts.hidden == t.hidden_size) and opts.layers > t.num_layers:
            raise UserError(f"--layers {opts.layers}: the target has only {t.num_layers} layers to start from")
        return
    if len(picks) != opts.layers or not all(0 <= i < t.num_layers for i in picks):
        raise UserError(f"--init-layers {','.join(map(str, picks))}: give {opts.layers} layer numbers "
                        f"in 0..{t.num_layers - 1}")


def _config_from_raw(raw: dict, work: Path) -> ModelConfig:
    """Parse a config dict with the same checks as a checkpoint's config.json."""
    tmp = work / "student-config"
    tmp.mkdir(exist_ok=True)
    _atomic_json(tmp / "config.json", raw)
    return load_config(tmp)


def _on_policy_text(target: _Model, tokenizer: Tokenizer, cfg: ModelConfig, opts: DistillOptions, work: Path,
                    dev: torch.device, progress: bool) -> list[dict]:
    """The target's answers to the prompt list, generated once (resumable) into work/data.json."""
    path = work / "data.json"
    data = json.loads(path.read_text()) if path.exists() else {"next_prompt": 0, "records": [], "done": False}
    if data["done"]:
        return data["records"]
    items = read_prompts(Path(opts.prompts) if opts.prompts else DEFAULT_PROMPTS)
    prompts = []
    for it in items:
        ids = tokenizer.encode_chat(it["messages"]) if "messages" in it else tokenizer.encode(it["prompt"])
        prompts.append(ids)
    goal = opts.gen_tokens if opts.gen_tokens is not None else max(opts.tokens // 2, 1)
    eos = set(cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    have = sum(len(r["ids"]) - r["start"] - 1 for r in data["records"])
    bar = tqdm(total=goal, initial=min(have, goal), desc="target answers", unit="tok", unit_scale=True,
               disable=None if progress else True)
    while have < goal and data["next_prompt"] < len(prompts):
        lo = data["next_prompt"]
        hi = min(lo + opts.gen_batch, len(prompts))
        batch = prompts[lo:hi]
        temps = [0.0 if (lo + i) % 2 == 0 else 0.8 for i in range(len(batch))]
        g = torch.Generator().manual_seed(opts.seed * 1_000_003 + lo)
        answers = generate_batch(target, batch, opts.max_answer_tokens, temps, eos, g)
        for i, (p, a) in enumerate(zip(batch, answers)):
            rec = {"ids": p + a, "start": len(p) - 1, "prompt": lo + i}
            data["records"].append(rec)
            have += len(a)
            bar.update(len(a))
        data["next_prompt"] = hi
        _atomic_json(path, data)
    bar.close()
    # the held-out sequences: every k-th one, never trained on
    n = len(data["records"])
    if n >= 4 and opts.val_sequences:
        step = max(2, n // opts.val_sequences) | 1  # odd: greedy and sampled answers alternate, hold out both
        for i, r in enumerate(data["records"]):
            r["val"] = i % step == step - 1
    data["done"] = True
    _atomic_json(path, data)
    return data["records"]


def _save_state(work: Path, tensors: dict, names: list[str], optim: torch.optim.Optimizer, state: Progress) -> None:
    """Weights, Adam moments and progress in one file, replaced in one rename: a kill at any
    moment leaves either the previous save or this one, never a mix."""
    out = {f"param/{n}": tensors[n] for n in names}
    steps = {}
    for n, p in zip(names, (tensors[n] for n in names)):
        s = optim.state.get(p)
        if s:
            out[f"exp_avg/{n}"] = s["exp_avg"]
            out[f"exp_avg_sq/{n}"] = s["exp_avg_sq"]
            steps[n] = float(s["step"])
    meta = {"progress": json.dumps(asdict(state)), "adam_steps": json.dumps(steps)}
    _atomic_tensors(work / "state.safetensors", out, meta)


def _load_state(work: Path, tensors: dict, names: list[str], optim: torch.optim.Optimizer) -> Progress:
    from safetensors import safe_open
    with safe_open(str(work / "state.safetensors"), "pt") as f:  # tensors and progress, one read
        raw = f.metadata()
        saved = {name: f.get_tensor(name) for name in f.keys()}
    meta = {"progress": json.loads(raw["progress"]), "adam_steps": json.loads(raw["adam_steps"])}
    with torch.no_grad():
        for n in names:
            tensors[n].copy_(saved[f"param/{n}"])
    for n in names:
        if n in meta["adam_steps"]:
            p = tensors[n]
            optim.state[p] = {"step": torch.tensor(meta["adam_steps"][n]),
                              "exp_avg": saved[f"exp_avg/{n}"].to(p.device),
                              "exp_avg_sq": saved[f"exp_avg_sq/{n}"].to(p.device)}
    return Progress(**meta["progress"])


def _finish(out: Path, work: Path, target_dir: Path, raw: dict, tensors: dict, opts: DistillOptions,
            state: Progress, n_train: int, n_val: int) -> Path:
    """Write the Hugging Face folder under a temporary name, then rename it to `out`."""
    dtype = parse_dtype(opts.save_dtype)
    remove_stale_temps(out.parent, f".{out.name}.tmp-*")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({n: w.detach().to(dtype).contiguous().cpu() for n, w in tensors.items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**raw, "torch_dtype": opts.save_dtype}, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, tmp / name)
    report = {"target": str(target_dir), "options": asdict(opts), "train_sequences": n_train,
              "val_sequences": n_val, "tokens_seen": state.tokens_seen, "steps": state.step,
              "seconds": state.seconds, "learning_curve": state.curve,
              "final_agreement": state.curve[-1]["agreement"] if state.curve else None}
    (tmp / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
    fsync_tree(tmp)
    if out.exists():
        out.rmdir()  # empty (checked at the start)
    os.replace(tmp, out)
    fsync_path(out.parent)
    shutil.rmtree(work)
    return out
