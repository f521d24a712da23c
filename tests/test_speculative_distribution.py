"""Distribution exactness of the real speculative loop (draft model growing the tree with its KV
cache and masks, target verifying in one pass, caches committed): tiny random Llama models with
an 8-token vocabulary, the first two tokens emitted after a fixed state against the target's
exact joint distribution. Threshold: chi-square p-value below 1e-4 fails (a correct sampler
fails 1 run in 10,000)."""

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.model import Transformer
from offload_engine.speculation.decoder import SpeculativeDecoder, TreeSpec
from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.sampling import SamplingParams, logits_to_probs

V = 8
SAMPLES = 6000
PARAMS = SamplingParams(0.8, 0.9)


def tiny(path, seed, layers, hidden):
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, initializer_range=0.5)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return Transformer.from_checkpoint(Checkpoint(path, load_config(path)), torch.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return tiny(root / "target", 1, 2, 32), tiny(root / "draft", 2, 1, 16)


def exact_joint(target, ids):
    """P(x1, x2 | ids) for the target, by enumeration."""
    out = np.zeros(V * V)
    p1 = logits_to_probs(target.forward(torch.tensor(ids), torch.arange(len(ids)), target.new_cache(len(ids)))[-1],
                         PARAMS).double().numpy()
    for a in range(V):
        seq = ids + [a]
        p2 = logits_to_probs(target.forward(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(len(seq)))[-1],
                             PARAMS).double().numpy()
        out[a * V:(a + 1) * V] = p1[a] * p2
    return out


@pytest.mark.parametrize("spec", [TreeSpec("sequoia", 7, 3, acceptance=AcceptanceVector((0.4, 0.2, 0.1))),
                                  TreeSpec("specexec", 7, 4, acceptance=AcceptanceVector((0.4, 0.2, 0.1)))],
                         ids=["sequoia", "specexec"])
def test_first_two_tokens_after_a_state_have_the_target_distribution(models, spec):
    target, draft = models
    prompt, root = [1, 5, 2], 3
    g = torch.Generator().manual_seed(17)
    dec = SpeculativeDecoder(target, draft, spec, PARAMS, g, 64)
    dec.prefill(prompt, 64)
    base_t, base_d = dec.target_cache.length, dec.draft_cache.length
    samples = []
    for _ in range(SAMPLES):
        out, r = [], root
        while len(out) < 2:
            step = dec.step(r)
            out += step.tokens
            r = step.tokens[-1]
        samples.append(out[0] * V + out[1])
        dec.target_cache.truncate(base_t)  # back to the same state for the next sample
        dec.draft_cache.truncate(base_d)
    exact = exact_joint(target, prompt + [root])
    counts = np.bincount(samples, minlength=V * V).astype(float)
    assert counts[exact == 0].sum() == 0
    big = exact * SAMPLES >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exact[big], exact[~big].sum()) * SAMPLES
    keep = exp > 0
    assert stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue > 1e-4
