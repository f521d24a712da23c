"""Plain decoding through the Engine: greedy against transformers, sampling statistics, stops."""

import json

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from offload_engine import Engine, UserError
from tiny_models import FAMILIES, make_tiny_checkpoint

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "m", "llama3-gqa", init_std=0.2)


@pytest.fixture(scope="module")
def engine(folder):
    return Engine.load(folder, progress=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_transformers_generate(tmp_path, family):
    folder = make_tiny_checkpoint(tmp_path / family, family, init_std=0.2, seed=7)
    engine = Engine.load(folder, progress=False)
    ids = engine.tokenizer.encode(PROMPT)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine.eos_token_ids = frozenset()  # compare 32 tokens whatever they are
    result = engine.generate(input_ids=ids, max_new_tokens=32)
    assert result.token_ids == expected[0, len(ids):].tolist()
    assert result.finish_reason == "length" and result.stats["new_tokens"] == 32


def test_streamed_text_equals_result_text(engine):
    pieces = []
    result = engine.generate(PROMPT, max_new_tokens=48, on_token=lambda t, s: pieces.append((t, s)))
    assert [t for t, _ in pieces] == result.token_ids
    assert "".join(s for _, s in pieces) == result.text
    assert result.text == engine.tokenizer.decode(result.token_ids)


def test_stops_at_eos_from_generation_config(tmp_path, folder):
    base = Engine.load(folder, progress=False)
    base.eos_token_ids = frozenset()
    free = base.generate(PROMPT, max_new_tokens=24).token_ids
    stop_at = next(i for i in range(3, 24) if free[i] not in free[:i])  # its first occurrence
    import shutil
    copy = shutil.copytree(folder, tmp_path / "m")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[stop_at]]}))
    result = Engine.load(copy, progress=False).generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == free[: stop_at + 1]
    assert result.finish_reason == "stop"


def test_stop_string_truncates_text_and_stream(engine):
    full = engine.generate(PROMPT, max_new_tokens=40)
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    pieces = []
    result = engine.generate(PROMPT, max_new_tokens=40, stop=[stop], on_token=lambda t, s: pieces.append(s))
    assert result.text == text[:cut]
    assert "".join(pieces) == text[:cut]
    assert result.finish_reason == "stop"
    assert result.token_ids == full.token_ids[: len(result.token_ids)]


def test_seed_reproducible_and_seeds_differ(engine):
    a = engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=11).token_ids
    b = engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=11).token_ids
    c = engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=12).token_ids
    assert a == b and a != c


def test_context_limits(folder):
    small = Engine.load(folder, max_context=12, progress=False)
    small.eos_token_ids = frozenset()
    with pytest.raises(UserError, match="context holds 12"):
        small.generate("word " * 40)
    ids = small.tokenizer.encode(PROMPT)
    result = small.generate(input_ids=ids, max_new_tokens=100)
    assert len(ids) + len(result.token_ids) == 12 and result.finish_reason == "length"


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
                                 dict(max_new_tokens=0), dict(input_ids=[10**6])])
def test_bad_sampling_arguments_are_refused(engine, bad):
    kwargs = {"max_new_tokens": 4, **bad}
    if "input_ids" not in kwargs:
        kwargs["prompt"] = PROMPT
    with pytest.raises(UserError):
        engine.generate(**kwargs)


def _reference_first_token_probs(folder, ids, temperature, top_p, top_k=0):
    """Exact next-token distribution from transformers' logits, truncated by hand in numpy."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, -1].double().numpy()
    if top_k:
        logits = np.where(logits >= np.sort(logits)[-top_k], logits, -np.inf)
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < top_p
    q = np.zeros_like(p)
    q[order[keep]] = p[order[keep]]
    return q / q.sum()


def _chi_square_pvalue(samples, probs, min_expected=5.0):
    """Pearson chi-square of sample counts against probs, pooling categories with < min_expected."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs * n
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


def test_sampled_first_token_has_the_models_distribution(folder, engine):
    """4000 draws of the first token at T=0.7, top-p 0.9 against the exact distribution.

    Threshold: fail when the chi-square p-value is below 1e-3 (a correct sampler fails 1 run in
    1000). The same samples against T=1.0 / no top-p must be rejected, so the test has power.
    """
    ids = engine.tokenizer.encode(PROMPT)
    samples = np.array([engine.generate(input_ids=ids, max_new_tokens=1, temperature=0.7, top_p=0.9,
                                        seed=s).token_ids[0] for s in range(4000)])
    exact = _reference_first_token_probs(folder, ids, 0.7, 0.9)
    assert _chi_square_pvalue(samples, exact) > 1e-3
    wrong = _reference_first_token_probs(folder, ids, 1.0, 1.0)
    assert wrong[exact == 0].sum() > 0.01  # top-p really cut something here
    assert _chi_square_pvalue(samples, wrong) < 1e-3


def test_sampled_first_token_with_top_k(folder, engine):
    """3000 draws at T=1.0, top-k 5: chi-square p-value above 1e-3 against the exact top-5
    distribution, and below 1e-3 against top-k 6 (the sixth token must never appear)."""
    ids = engine.tokenizer.encode(PROMPT)
    samples = np.array([engine.generate(input_ids=ids, max_new_tokens=1, temperature=1.0, top_k=5,
                                        seed=10_000 + s).token_ids[0] for s in range(3000)])
    exact = _reference_first_token_probs(folder, ids, 1.0, 1.0, top_k=5)
    assert (exact > 0).sum() == 5
    assert _chi_square_pvalue(samples, exact) > 1e-3
    wider = _reference_first_token_probs(folder, ids, 1.0, 1.0, top_k=6)
    assert wider[exact == 0].sum() > 0.01
    assert _chi_square_pvalue(samples, wider) < 1e-3
