"""Draft levels as padded static passes (runtime/draft_graphs.py), the form a CUDA graph replays:
run eagerly here, they must give the plain pass's logits and K/V, leave every other slot alone,
and keep speculation exact. The capture itself runs in test_cuda.py."""

import pytest
import torch

from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.runtime.draft_graphs import StaticLevels, bucket_for, keys_bucket
from offload_engine.runtime.model import Transformer
from offload_engine.speculation.decoder import SpeculativeDecoder, TreeSpec
from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.sampling import SamplingParams
from tiny_models import make_tiny_pair, perturbed_copy


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    target_dir, _ = make_tiny_pair(root)
    draft_dir = perturbed_copy(target_dir, root / "partial", 0.05, seed=3)
    load = lambda d: Transformer.from_checkpoint(Checkpoint(d, load_config(d)), torch.float32)  # noqa: E731
    return load(target_dir), load(draft_dir)


@pytest.fixture(scope="module")
def draft64(tmp_path_factory):
    """The draft in float64: a padded pass sums in another order than the plain one (another matmul
    shape), which in float32 moves logits by a few 1e-5 on some CPUs (seen on CI); in float64 the
    two agree to 1e-12 (the logits to float32's rounding), so a tight tolerance still catches a wrong mask, slot or position."""
    root = tmp_path_factory.mktemp("graphs64")
    target_dir, _ = make_tiny_pair(root)
    draft_dir = perturbed_copy(target_dir, root / "partial", 0.05, seed=3)
    return Transformer.from_checkpoint(Checkpoint(draft_dir, load_config(draft_dir)), torch.float64)


def test_buckets():
    assert [bucket_for(w) for w in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert bucket_for(257) is None
    assert [keys_bucket(n, 9216) for n in (1, 256, 257, 700, 5000, 9000)] == [256, 256, 512, 1024, 8192, 9216]
    assert keys_bucket(30, 64) == 64


@pytest.mark.parametrize("capacity", [64, 700])  # the pass attends over all 64 slots; over 256 of 700
@pytest.mark.parametrize("width", [1, 3, 5, 17])
def test_a_padded_level_equals_the_plain_pass(draft64, width, capacity):
    draft = draft64
    g = torch.Generator().manual_seed(width)
    V = draft.cfg.vocab_size
    prefix = torch.randint(0, V, (11,), generator=g)
    caches = [draft.new_cache(capacity) for _ in range(2)]
    for c in caches:
        draft.forward(prefix, torch.arange(11), c)
        c.advance(11)
    before = [c.k.clone() for c in caches]
    tokens = torch.randint(0, V, (width,), generator=g)
    tree_mask = torch.tril(torch.rand(width, width, generator=g) < 0.6) | torch.eye(width, dtype=torch.bool)
    positions = torch.arange(width) + 11
    mask = torch.cat([torch.ones(width, 11, dtype=torch.bool), tree_mask], 1)
    expected = draft.forward(tokens, positions, caches[0], mask=mask)
    levels = StaticLevels(draft, caches[1], capture=False)
    got = levels.run(tokens, positions, tree_mask, 11)
    assert caches[1].k.dtype == torch.float64  # (the logits come back as float32, rounded once)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    end = 11 + width
    torch.testing.assert_close(caches[1].k[:, :, :, :end], caches[0].k[:, :, :, :end], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(caches[1].v[:, :, :, :end], caches[0].v[:, :, :, :end], atol=1e-10, rtol=1e-10)
    assert torch.equal(caches[1].k[:, :, :, :11], before[1][:, :, :, :11])  # the committed slots untouched
    pad_end = 11 + bucket_for(width)
    assert torch.equal(caches[1].k[:, :, :, pad_end:], before[1][:, :, :, pad_end:])  # nothing past the pads
    assert levels.eager == 1 and levels.replays == 0


def test_a_level_that_does_not_fit_runs_as_a_plain_pass(models):
    _, draft = models
    cache = draft.new_cache(20)
    cache.length = 15
    levels = StaticLevels(draft, cache, capture=False)
    assert levels.fits(4) and not levels.fits(5) and not levels.fits(300)  # 5 pads to 8: 23 > 20


KINDS = {"sequoia": TreeSpec("sequoia", 24, 5, acceptance=AcceptanceVector((0.5, 0.2, 0.1))),
         "specexec": TreeSpec("specexec", 24, 5, acceptance=AcceptanceVector((0.4, 0.2, 0.1, 0.05))),
         "specinfer": TreeSpec("specinfer", 0, 4, specinfer_width=3), "chain": TreeSpec("chain", 0, 5)}


def _generate(target, draft, spec, modes, params, n=30, seed=0):
    dec = SpeculativeDecoder(target, draft, spec, params, torch.Generator().manual_seed(seed), 128,
                             verify=modes[0], draft_graphs=modes[1])
    ids = [t % target.cfg.vocab_size for t in (5, 17, 3, 9, 250, 11)]  # (test_cuda's pair has 8 tokens)
    out = [dec.first_token(dec.prefill(ids, 64))]
    while len(out) < n:
        out += dec.step(out[-1]).tokens
    return out[:n], dec


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_with_padded_levels_and_the_device_table_equals_plain(models, kind):
    target, draft = models
    plain, _ = _generate(target, None, TreeSpec(), ("walk", "off"), SamplingParams())
    got, dec = _generate(target, draft, KINDS[kind], ("table", "eager"), SamplingParams())
    assert got == plain
    assert dec.draft_levels.eager > 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_sampled_tokens_do_not_depend_on_where_verification_runs(models, kind):
    """The table verifier makes the walk's decisions from the same uniforms, so with the same
    seed (and the same draft passes) the sampled tokens are the same."""
    target, draft = models
    params = SamplingParams(0.8)
    walk, _ = _generate(target, draft, KINDS[kind], ("walk", "off"), params, seed=4)
    table, _ = _generate(target, draft, KINDS[kind], ("table", "off"), params, seed=4)
    assert walk == table
