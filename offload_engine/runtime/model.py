"""The Llama-family math: embedding, RMSNorm, RoPE (with llama3 scaling), GQA attention over a
KV cache with an explicit mask and explicit position ids, SwiGLU MLP, final norm and head.

Layers are plain dicts of tensors (names relative to "model.layers.{i}.") so that an executor
can own where their weights live; `decoder_layer` is a pure function of (weights, activations,
cache). Prefill, decode and tree verification all go through `Transformer.forward`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import GenerationCancelled
from ..formats.checkpoint import Checkpoint
from ..formats.config import ModelConfig
from .attention import attend
from .attention import resolve as resolve_attention
from .kv_cache import KVCache

LayerWeights = dict[str, torch.Tensor]
FUSED_QKV, FUSED_GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"  # (`fuse_projections`)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as the reference implementation does (x * rsqrt(mean(x^2) + eps),
    then cast back and scaled): one fused op where torch has it."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2], with llama3 or linear scaling applied when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.kind == "linear":
        return inv_freq / rs.factor
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend in between.
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class Rope:
    cos: torch.Tensor  # [1, 1, S, D] or [B, 1, S, D]
    sin: torch.Tensor

    @staticmethod
    def at(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """positions [S] (one sequence) or [B, S] (a batch, each row its own positions)."""
        freqs = positions.float()[..., None] * inv_freq  # [(B,) S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [(B,) S, D]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        if positions.dim() == 1:
            return Rope(cos[None, None], sin[None, None])
        return Rope(cos[:, None], sin[:, None])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + rotated * self.sin


def _linear(x: torch.Tensor, w: LayerWeights, name: str) -> torch.Tensor:
    weight = w[name + ".weight"]
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, w.get(name + ".bias"))
    return weight.linear(x, w.get(name + ".bias"))  # a quantised weight (quant.QuantizedLinear)


def attention(w: LayerWeights, x: torch.Tensor, rope: Rope, cache: KVCache, layer: int,
              mask: torch.Tensor, cfg: ModelConfig, backend: str = "sdpa",
              slots: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention of the new tokens over the cached prefix plus themselves (or, with
    `slots`, over the static cache's first mask-width slots, the new K/V written at those slots)."""
    B, S, _ = x.shape
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if FUSED_QKV in w:  # a self-draft's one matrix for q, k and v (`fuse_projections`): rope once on q and k
        qkv = _linear(x, w, FUSED_QKV[:-len(".weight")])
        qk = rope.apply(qkv[..., :(H + KVH) * D].view(B, S, H + KVH, D).transpose(1, 2))
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[..., (H + KVH) * D:].view(B, S, KVH, D).transpose(1, 2)
    else:
        q = _linear(x, w, "self_attn.q_proj").view(B, S, H, D).transpose(1, 2)
        k = _linear(x, w, "self_attn.k_proj").view(B, S, KVH, D).transpose(1, 2)
        v = _linear(x, w, "self_attn.v_proj").view(B, S, KVH, D).transpose(1, 2)
        q, k = rope.apply(q), rope.apply(k)  # q: [B, H, S, D]; k, v: [B, KVH, S, D]
    if slots is None:
        keys, values = cache.write(layer, k, v)  # [B, KVH, T, D], T = cached + S
    else:  # T = the mask's width: the first T slots of the static cache (a fixed shape per graph)
        keys, values = cache.write_at(layer, k, v, slots, mask.shape[-1])
    mask = mask[None, None] if mask.dim() == 2 else mask[:, None]  # [S, T] shared, or [B, S, T] per row
    out = attend(q, keys, values, mask, backend)
    out = out.transpose(1, 2).reshape(B, S, cfg.num_heads * cfg.head_dim)  # [B, S, H*D]
    return _linear(out, w, "self_attn.o_proj")


def mlp(w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    if FUSED_GATE_UP in w:  # a self-draft's one matrix for gate and up (`fuse_projections`)
        gate, up = _linear(x, w, FUSED_GATE_UP[:-len(".weight")]).chunk(2, dim=-1)
        return _linear(F.silu(gate) * up, w, "mlp.down_proj")
    return _linear(F.silu(_linear(x, w, "mlp.gate_proj")) * _linear(x, w, "mlp.up_proj"), w, "mlp.down_proj")


def fuse_projections(layer: LayerWeights, make) -> LayerWeights:
    """A layer's q, k and v matrices as one (FUSED_QKV), and gate and up as one (FUSED_GATE_UP),
    each built by `make` from the float matrices stacked by rows; the rest as they are. Fewer,
    larger matmuls: a quantised self-draft's level is short calls (on the 2-vCPU machine a width-1
    int8 matmul took 30-90 us, a third of it the call around the kernel). Rows are independent
    in every scheme here (per-row int8 scales, int4 groups along a row), so the fused matrices
    give the separate ones' outputs bit for bit (tested). Layers with biases are left as they are."""
    names = {FUSED_QKV: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             FUSED_GATE_UP: ("mlp.gate_proj", "mlp.up_proj")}
    out = dict(layer)
    for fused, parts in names.items():
        if any(p + ".bias" in layer for p in parts) or not all(p + ".weight" in layer for p in parts):
            continue
        out[fused] = make(torch.cat([layer[p + ".weight"].float() for p in parts]))
        for p in parts:
            del out[p + ".weight"]
    return out


def decoder_layer(w: LayerWeights, x: torch.Tensor, rope: Rope, cache: KVCache, layer: int,
                  mask: torch.Tensor, cfg: ModelConfig, backend: str = "sdpa",
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    h = x + attention(w, rms_norm(x, w["input_layernorm.weight"], cfg.rms_norm_eps), rope, cache,
                      layer, mask, cfg, backend, slots)
    return h + mlp(w, rms_norm(h, w["post_attention_layernorm.weight"], cfg.rms_norm_eps))


def causal_mask(past: int, new: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """[new, past+new] bool: each new token sees the whole past and the new tokens up to itself."""
    cols = torch.arange(past + new, device=device)
    rows = torch.arange(new, device=device)[:, None] + past
    return cols[None, :] <= rows


def load_globals(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors outside the decoder layers: embeddings, final norm, and the head when untied."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not ckpt.config.tie_word_embeddings:
        names.append("lm_head.weight")
    return {n: ckpt.load(n, dtype, device) for n in names}


class Transformer:
    """A Llama-family decoder. `layers` is any re-iterable of per-layer weights on the device: a
    list when everything is resident, a `LayerExecutor` when layers stream in."""

    def __init__(self, cfg: ModelConfig, globals_: dict[str, torch.Tensor], layers: Iterable[LayerWeights],
                 dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        self.embed = globals_["model.embed_tokens.weight"]
        self.norm = globals_["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else globals_["lm_head.weight"]
        self.layers = layers
        self.dtype = dtype
        self.device = device
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.attention = resolve_attention(None, device)  # the kernel every pass uses (runtime/attention.py)
        # set by the engine for one generation: when the event is set, the next layer boundary
        # raises GenerationCancelled (the layer executor restarts its loader for the next pass)
        self.interrupt: threading.Event | None = None
        # a substitute self-draft (speculation/drafts.py): runs on the target's KV cache
        self.shares_cache = False
        # a self-draft on the CPU: the head as an int8 matrix (quant.QuantizedLinear), its logits
        # from that (speculation/drafts.py: the float head is most of a width-1 level's reads)
        self.quantized_head = None

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype, device: str | torch.device = "cpu",
                        packed: bool = False) -> "Transformer":
        """Every weight resident on `device`: dequantized to `dtype` once, or (packed) each layer
        kept in its checkpoint's own formats and dequantized per use (a draft loaded from a GGUF)."""
        device = torch.device(device)
        if packed:
            from .layer_store import packed_layer, store_layout
            layout = store_layout(ckpt, dtype)
            layers = [packed_layer(ckpt, i, layout.layouts[i], device) for i in range(ckpt.config.num_layers)]
        else:
            layers = [ckpt.load_layer(i, dtype, device) for i in range(ckpt.config.num_layers)]
        return cls(ckpt.config, load_globals(ckpt, dtype, device), layers, dtype, device)

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, logits_rows: slice | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S', V] (fp32) for new tokens input_ids [S] at `positions` [S].

        mask: [S, cache.length + S] bool (True = may attend); causal when None.
        The new tokens' K/V are written after cache.length; the caller keeps them with
        cache.advance / cache.commit. logits_rows selects the rows that need logits.
        slots: [S] device tensor of the cache slots to write instead (the mask [S, T] then covers
        the cache's first T slots, T fixed per graph): a pass whose shapes and pointers never
        change, as a CUDA graph needs (runtime/draft_graphs.py).
        """
        steps = self.forward_steps(input_ids, positions, cache, mask, logits_rows, slots)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()  # (on a generator: entered at every resumption)
    def forward_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      mask: torch.Tensor | None = None, logits_rows: slice | None = None,
                      slots: torch.Tensor | None = None):
        """`forward` as a generator that yields after each layer and returns the logits: work
        that can be done a layer at a time in another pass's waits (a draft growing ahead)."""
        S = input_ids.shape[0]
        if mask is None:
            mask = causal_mask(cache.length, S, self.device)
        rope = Rope.at(self.inv_freq, positions.to(self.device), self.dtype)
        x = F.embedding(input_ids.to(self.device), self.embed)[None]  # [1, S, hidden]
        for i, w in enumerate(self.layers):
            if self.interrupt is not None and self.interrupt.is_set():
                raise GenerationCancelled("generation cancelled")
            x = decoder_layer(w, x, rope, cache, i, mask, self.cfg, self.attention, slots)
            yield
        if logits_rows is not None:
            x = x[:, logits_rows]
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        if self.quantized_head is not None:
            return self.quantized_head.linear(x)[0].float()
        return F.linear(x, self.lm_head)[0].float()  # [S', V]
