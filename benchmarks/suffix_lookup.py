"""What a suffix draft's lookup costs next to a store of earlier text (`--suffix-memory`).

    python benchmarks/suffix_lookup.py [--tokens 1000000] [--steps 200]

The store is filled to its cap with Zipf-distributed token sequences over a 49,152-token
vocabulary (common tokens very common, as in text: the worst case for the scan, whose candidate
positions are those of the last token), a 500-token prompt is drafted from, and each step's
lookup (both sources, the tree built) is timed. Prints ms per lookup and the store's bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from offload_engine.speculation.suffix import SuffixDrafter, SuffixStore
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    rng, vocab = np.random.default_rng(0), 49152
    store = SuffixStore(args.tokens)
    while store.tokens < 0.999 * args.tokens:
        store.add("k", [], (rng.zipf(1.3, int(rng.integers(200, 800))) % vocab).tolist())
    snap = store.snapshot("k")
    drafter = SuffixDrafter((rng.zipf(1.3, 500) % vocab).tolist(), snap, 65)
    t0, matched = time.perf_counter(), 0
    for _ in range(args.steps):
        root = int(rng.zipf(1.3) % vocab)
        matched += drafter.propose(root).size > 1
        drafter.extend([root])
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    print(f"store of {store.tokens:,} tokens ({snap.nbytes / 2**20:.1f} MiB): {ms:.2f} ms per lookup "
          f"({matched} of {args.steps} steps matched)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
