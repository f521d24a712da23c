"""KVCache: writes land after the committed length; advance, commit(slots) and truncate."""

import pytest
import torch

from offload_engine.runtime.kv_cache import KVCache


def _filled(n_layers=2, capacity=16):
    cache = KVCache(n_layers, 2, 4, capacity, torch.float32)
    return cache


def test_write_then_advance_keeps_tokens_in_order():
    cache = _filled()
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    keys, values = cache.write(0, k, -k)
    assert keys.shape == (1, 2, 3, 4) and torch.equal(keys, k) and torch.equal(values, -k)
    cache.advance(3)
    k2 = torch.full((1, 2, 2, 4), 7.0)
    keys, _ = cache.write(0, k2, k2)
    assert keys.shape[2] == 5 and torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 3:], k2)


def test_commit_gathers_chosen_slots_into_the_next_positions_for_every_layer():
    cache = _filled()
    cache.advance(2)
    tree = torch.randn(2, 1, 2, 6, 4)  # 6 scratch slots after the 2 committed ones, per layer
    for layer in range(2):
        cache.write(layer, tree[layer], tree[layer] * 2)
    cache.commit([2 + 1, 2 + 4, 2 + 5])
    assert cache.length == 5
    for layer in range(2):
        assert torch.equal(cache.k[layer, :, :, 2:5], tree[layer][:, :, [1, 4, 5]])
        assert torch.equal(cache.v[layer, :, :, 2:5], tree[layer][:, :, [1, 4, 5]] * 2)


def test_truncate_and_overflow():
    cache = _filled(capacity=4)
    cache.advance(3)
    cache.truncate(1)
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.truncate(2)
    with pytest.raises(ValueError):
        cache.write(0, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError):
        cache.advance(4)
