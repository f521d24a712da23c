"""The attention backends (runtime/attention.py) against PyTorch's own SDPA, the reference: same
output on grouped-query heads with tree-shaped, causal and per-row masks, and the same logits
through a whole model; on CUDA the same comparison runs in test_cuda.py."""

import pytest
import torch

from offload_engine.runtime import attention
from offload_engine.runtime.model import Transformer, causal_mask


def _tree_mask(S: int, T: int, g: torch.Generator) -> torch.Tensor:
    """[S, T]: every row sees a random prefix of the past, a random set of earlier new tokens and itself."""
    past = T - S
    mask = torch.zeros(S, T, dtype=torch.bool)
    mask[:, :past] = torch.rand(S, 1, generator=g) < 0.9
    mask[:, :1] = True
    for i in range(S):
        mask[i, past:past + i] = torch.rand(i, generator=g) < 0.5
        mask[i, past + i] = True
    return mask


@pytest.mark.parametrize("backend", ["efficient", "matmul"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("S,T", [(1, 9), (5, 5), (33, 70)])
def test_backends_equal_sdpa(backend, heads, kv_heads, S, T):
    g = torch.Generator().manual_seed(S * 100 + T + heads)
    for B, per_row in ((1, False), (2, True)):
        q = torch.randn(B, heads, S, 16, generator=g)
        k, v = (torch.randn(B, kv_heads, T, 16, generator=g) for _ in range(2))
        if per_row:
            mask = torch.stack([_tree_mask(S, T, g) for _ in range(B)])[:, None]
        else:
            mask = _tree_mask(S, T, g)[None, None]
        expected = attention.attend(q, k, v, mask, "sdpa")
        torch.testing.assert_close(attention.attend(q, k, v, mask, backend), expected, atol=2e-6, rtol=2e-5)


def test_causal_rows_equal_sdpa_in_bfloat16():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 12, 32, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 20, 32, generator=g).bfloat16() for _ in range(2))
    mask = causal_mask(8, 12)[None, None]
    expected = attention.attend(q, k, v, mask, "sdpa").float()
    for backend in ("efficient", "matmul"):
        torch.testing.assert_close(attention.attend(q, k, v, mask, backend).float(), expected, atol=2e-2, rtol=2e-2)


def test_resolve_by_device_argument_and_environment(monkeypatch):
    monkeypatch.delenv(attention.ENV, raising=False)
    assert attention.resolve(None, torch.device("cpu")) == "sdpa"
    assert attention.resolve(None, torch.device("cuda")) == "efficient"
    assert attention.resolve("matmul", torch.device("cpu")) == "matmul"
    monkeypatch.setenv(attention.ENV, "matmul")
    assert attention.resolve(None, torch.device("cuda")) == "matmul"
    monkeypatch.setenv(attention.ENV, "cudnn")
    with pytest.raises(ValueError, match="cudnn"):
        attention.resolve(None, torch.device("cpu"))


def test_a_model_gives_the_same_logits_with_every_backend(tmp_path):
    """Prefill then a tree-masked pass through a tiny GQA model, per backend, against sdpa."""
    from offload_engine.formats.checkpoint import Checkpoint
    from offload_engine.formats.config import load_config
    from tiny_models import make_tiny_checkpoint
    folder = make_tiny_checkpoint(tmp_path / "m")
    # float64: the backends sum in other orders, which in float32 differs by ~1e-5 from CPU to CPU
    model = Transformer.from_checkpoint(Checkpoint(folder, load_config(folder)), torch.float64)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.cfg.vocab_size, (20,), generator=g)
    tree = torch.randint(0, model.cfg.vocab_size, (7,), generator=g)
    mask = torch.cat([torch.ones(7, 20, dtype=torch.bool), _tree_mask(7, 7, g)], 1)
    out = {}
    for backend in ("sdpa", "efficient", "matmul"):
        model.attention = backend
        cache = model.new_cache(32)
        prefill = model.forward(ids, torch.arange(20), cache)
        cache.advance(20)
        out[backend] = (prefill, model.forward(tree, torch.arange(20, 27), cache, mask=mask))
    for backend in ("efficient", "matmul"):
        for got, expected in zip(out[backend], out["sdpa"]):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
