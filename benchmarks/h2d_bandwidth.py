"""Host-to-device copy bandwidth from pinned and from pageable memory (needs CUDA).

    python benchmarks/h2d_bandwidth.py [--mib 1024] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def bandwidth_gbps(nbytes: int, pinned: bool, repeats: int) -> float:
    """The profiler's measurement (the one `--tree auto` relies on), on the current GPU."""
    import torch
    from offload_engine.planning.profiler import h2d_gbps
    return h2d_gbps(nbytes, torch.device("cuda"), pinned, repeats)


def main(argv: list[str] | None = None) -> int:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("h2d_bandwidth: no CUDA device", file=sys.stderr)
        return 2
    n = args.mib * 2**20
    t0 = time.perf_counter()
    result = {"gpu": torch.cuda.get_device_name(), "bytes": n,
              "pinned_gbps": bandwidth_gbps(n, True, args.repeats),
              "pageable_gbps": bandwidth_gbps(n, False, args.repeats)}
    result["pinned_over_pageable"] = result["pinned_gbps"] / result["pageable_gbps"]
    result["seconds"] = time.perf_counter() - t0
    print(f"{result['gpu']}: host-to-device {args.mib} MiB: pinned {result['pinned_gbps']:.1f} GB/s, "
          f"pageable {result['pageable_gbps']:.1f} GB/s ({result['pinned_over_pageable']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
