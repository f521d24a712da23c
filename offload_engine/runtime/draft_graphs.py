"""A resident draft's narrow passes (one tree level each) as replayed CUDA graphs.

A draft level of an 8B-shaped draft launches a few hundred small kernels (16-32 layers, each a
dozen ops) for a few dozen tokens: on a GPU the Python and launch overhead, not the weights' reads,
sets its time (measured on one H200: about 1 ms per layer per level). A CUDA graph replays the whole
pass with one launch, but it needs every shape and pointer fixed. So a level of width w runs at
the next bucket width b (1, 2, 4, ..., 256) from static buffers: token ids, positions, a mask row
over the first T cache slots per query (T a power-of-two bucket of the slots in use, so that
a graph serves many steps without attending over the whole capacity), and the slots its K/V go to (`Transformer.forward`'s
`slots`: an index_copy into the static cache, whose offsets are values in a buffer, not Python
ints). Pad rows (w..b-1) attend to slot 0 only and write their K/V to the scratch slots just after
the level's own, which later levels overwrite and the commit never keeps.

`StaticLevels(model, cache, capture=False)` runs the same padded pass eagerly: it is how the CPU
tests check everything but the capture itself (tests/test_draft_graphs.py). With capture=True (a
GPU), each bucket's pass is captured on first use, all buckets sharing one memory pool, and each
replay's logits are cloned out of the pool before the next. A capture that fails (an op that
cannot be captured) turns graphs off for this runner with one warning, and levels run eagerly.
"""

from __future__ import annotations

import sys

import torch

from ..errors import GenerationCancelled
from .kv_cache import KVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_KEYS = 256  # key-length buckets: powers of two from here up to the cache's capacity


def bucket_for(width: int) -> int | None:
    for b in BUCKETS:
        if b >= width:
            return b
    return None


def keys_bucket(needed: int, capacity: int) -> int:
    """How many cache slots a static pass attends over: the next power of two >= needed (at least
    MIN_KEYS), at most the capacity. So a pass costs at most twice the attention it needs, and a
    long generation captures a handful of key lengths per width, not one per token."""
    t = MIN_KEYS
    while t < needed:
        t *= 2
    return min(t, capacity)


class StaticLevels:
    def __init__(self, model, cache: KVCache, capture: bool):
        self.model, self.cache, self.capture = model, cache, capture
        self.attention = model.attention  # the backend captured graphs replay (a change needs new ones)
        self.device = model.device
        self._buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._arange = torch.arange(max(BUCKETS), device=self.device)
        self.replays = 0  # levels run from a captured graph (reported by benchmarks/gpu_step.py)
        self.eager = 0  # levels run as padded eager passes

    def fits(self, width: int) -> bool:
        """Whether a level of `width` new tokens can run here (its bucket fits in the cache)."""
        b = bucket_for(width)
        return b is not None and self.cache.length + b <= self.cache.capacity

    def _buffers_for(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        if key not in self._buffers:
            dev, (b, keys) = self.device, key
            self._buffers[key] = {"ids": torch.zeros(b, dtype=torch.long, device=dev),
                                  "positions": torch.zeros(b, dtype=torch.long, device=dev),
                                  "mask": torch.zeros(b, keys, dtype=torch.bool, device=dev),
                                  "slots": torch.zeros(b, dtype=torch.long, device=dev)}
        return self._buffers[key]

    def _pass(self, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.forward(bufs["ids"], bufs["positions"], self.cache, mask=bufs["mask"], slots=bufs["slots"])

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, tree_base: int) -> torch.Tensor:
        """Logits [w, V] for a level of w = len(tokens) new tokens written after cache.length.
        tree_mask: [w, n] the level's rows over tree nodes 0..n-1, whose slots start at tree_base
        (so n = cache.length + w - tree_base). The caller advances the cache."""
        w = tokens.shape[0]
        b = bucket_for(w)
        length = self.cache.length
        key = (b, keys_bucket(length + b, self.cache.capacity))
        bufs = self._buffers_for(key)
        bufs["ids"][:w] = tokens.clamp_min(0)
        bufs["ids"][w:] = 0
        bufs["positions"][:w] = positions
        bufs["positions"][w:] = 0
        mask = bufs["mask"]
        mask.zero_()
        mask[:w, :tree_base] = True
        mask[:w, tree_base:tree_base + tree_mask.shape[1]] = tree_mask
        mask[w:, 0] = True  # pad rows: one visible slot, so their softmax is finite
        torch.add(self._arange[:b], length, out=bufs["slots"])
        if self.capture:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(key, bufs)
            if graph is not None:
                graph[0].replay()
                self.replays += 1
                return graph[1][:w].clone()
        self.eager += 1
        return self._pass(bufs)[:w]

    def _capture(self, key: tuple[int, int], bufs: dict[str, torch.Tensor]):
        """Capture the bucket's pass (after two warm-up runs on a side stream, as CUDA graphs need);
        None, and graphs off for this runner, if the capture fails. The capture is thread-local:
        the layer loader's thread keeps synchronizing its own events meanwhile."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._pass(bufs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._pass(bufs)
            self._pool = graph.pool()
        except GenerationCancelled:  # a cancel, not a failure: graphs stay on
            raise
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say so once
            print(f"sequoia-offload: warning: CUDA graph capture of a {key[0]}-wide draft level failed "
                  f"({type(e).__name__}: {e}); draft levels run without graphs", file=sys.stderr)
            self.capture = False
            return None
        self._graphs[key] = (graph, out)
        return self._graphs[key]
