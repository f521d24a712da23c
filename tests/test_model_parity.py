"""Our Llama-family math against transformers' own model classes, on tiny random checkpoints."""

import dataclasses

import pytest
import torch
import transformers
from torch.testing import assert_close

from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.model import Transformer, causal_mask
from tiny_models import FAMILIES, make_tiny_checkpoint

TOL = dict(atol=2e-5, rtol=1e-4)  # fp32: summation order may differ from the reference


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, init_std=0.1)
    cfg = load_config(folder)
    ours = Transformer.from_checkpoint(Checkpoint(folder, cfg), torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, ours, ref


def _ids(cfg, n, seed=0):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_full_sequence_logits_match_reference(pair):
    _, ours, ref = pair
    ids = _ids(ours.cfg, 48)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = ours.forward(ids, torch.arange(48), ours.new_cache(48))
    assert_close(got, expected, **TOL)


def test_kv_cached_step_by_step_logits_match_reference(pair):
    _, ours, ref = pair
    ids = _ids(ours.cfg, 40, seed=1)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    cache = ours.new_cache(40)
    rows = [ours.forward(ids[:16], torch.arange(16), cache)]
    cache.advance(16)
    for t in range(16, 24):  # single-token decode
        rows.append(ours.forward(ids[t:t + 1], torch.tensor([t]), cache))
        cache.advance(1)
    # a 16-token chunk with an explicit (causal) mask over the 24 cached tokens
    rows.append(ours.forward(ids[24:], torch.arange(24, 40), cache, mask=causal_mask(24, 16)))
    cache.advance(16)
    assert cache.length == 40
    assert_close(torch.cat(rows), expected, **TOL)


def test_last_row_logits_equal_full_logits(pair):
    _, ours, _ = pair
    ids = _ids(ours.cfg, 20, seed=2)
    full = ours.forward(ids, torch.arange(20), ours.new_cache(20))
    last = ours.forward(ids, torch.arange(20), ours.new_cache(20), logits_rows=slice(19, 20))
    assert_close(last, full[19:], **TOL)  # a 1-row matmul may block differently


def test_family_features_are_exercised(pair):
    """Guard against a parity test that passes because a feature silently does nothing."""
    name, ours, _ = pair
    cfg = ours.cfg
    if name == "llama3-gqa":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3"
        plain = Transformer(dataclasses.replace(cfg, rope_scaling=None),
                            {"model.embed_tokens.weight": ours.embed, "model.norm.weight": ours.norm,
                             "lm_head.weight": ours.lm_head}, ours.layers, ours.dtype, ours.device)
        ids = _ids(cfg, 48)
        a = ours.forward(ids, torch.arange(48), ours.new_cache(48))
        b = plain.forward(ids, torch.arange(48), plain.new_cache(48))
        assert (a - b).abs().max() > 1e-4
    if name == "qwen2":
        assert cfg.qkv_bias and "self_attn.q_proj.bias" in ours.layers[0]
        assert ours.layers[0]["self_attn.q_proj.bias"].abs().sum() > 0
    if name == "smollm-tied":
        assert cfg.tie_word_embeddings and ours.lm_head is ours.embed
    if name != "llama2-mha":
        assert cfg.num_kv_heads < cfg.num_heads
    else:
        assert cfg.num_kv_heads == cfg.num_heads
