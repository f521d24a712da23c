"""Sampling transforms against transformers' logits processors; incremental text and stop strings."""

import pytest
import torch
from torch.testing import assert_close
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from offload_engine.formats.detokenize import TextStream
from sequoia_trees.sampling import SamplingParams, logits_to_probs
from tiny_models import train_tokenizer


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.6, 1.0, 0), (0.6, 0.9, 0),
                                                     (1.3, 0.5, 0), (0.8, 1.0, 5), (0.7, 0.8, 20)])
def test_logits_to_probs_matches_transformers(temperature, top_p, top_k):
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(0)) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    expected = torch.softmax(ref, dim=-1)
    got = logits_to_probs(logits, SamplingParams(temperature, top_p, top_k))
    assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert ((got > 0) == (expected > 0)).all()


def test_greedy_probs_are_one_hot_on_argmax():
    logits = torch.randn(5, 50)
    probs = logits_to_probs(logits, SamplingParams(0.0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(5))


def _stream_all(decode, ids, stop=None):
    stream = TextStream(decode, stop)
    pieces = []
    for t in ids:
        pieces.append(stream.push(t))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return stream, pieces


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def test_multibyte_characters_split_across_tokens_are_held_back(tok):
    text = "naïve café 😀 done 中文"
    ids = tok.encode(text).ids
    stream, pieces = _stream_all(tok.decode, ids)
    assert "".join(pieces) == text == stream.text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len(text.encode()) / 2  # byte-level tokens really split characters here


@pytest.mark.parametrize("stop,expected", [("café", "naïve "), ("é 😀", "naïve caf"), ("zzz", None),
                                           ("naïve", "")])
def test_stop_strings(tok, stop, expected):
    text = "naïve café 😀 done"
    stream, pieces = _stream_all(tok.decode, tok.encode(text).ids, stop=[stop, "never"])
    want = text if expected is None else expected
    assert "".join(pieces) == want == stream.text
    assert stream.stopped == (expected is not None)


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    stream = TextStream(tok.decode, stop=["END"])
    shown = ""
    for t in tok.encode("abc EN").ids:
        shown += stream.push(t)
    assert shown == "abc " and not stream.stopped  # "EN" might become "END"
    shown += stream.finish()
    assert shown == "abc EN"
