"""Read verification benchmark: what checking layer blocks against their CRC-32 costs the disk tier.

    python benchmarks/verify_reads.py [--mib 384] [--block-mib 16] [--passes 11] [--json out.json]

A store-shaped file of random blocks (4 KiB aligned, `--mib` in all) is written next to the cache
(on the disk the stores live on, not in RAM) and read whole with O_DIRECT, as the streamer reads a
disk-tier pass, in three modes measured round-robin in one run so all see the same disk:
  none:  no checksums (the reader before this check existed);
  first: each block checked on its first read after opening (the default), timed on the first
         pass (every block checked) and on the later passes (the steady state: no check);
  every: every read checked (--verify-reads);
  every_unoverlapped: the same, each block read whole then checksummed, without the reader's
         helper threads (what the chunked, overlapped, parallel check saves).
Ratios are pass times over the `none` pass time (medians). The checksum functions' own speed
over a block in memory is measured too (why CRC-32: see docs/streaming.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=384, help="store size in MiB (default 384)")
    p.add_argument("--block-mib", type=int, default=16, help="block (layer) size in MiB (default 16)")
    p.add_argument("--passes", type=int, default=11, help="passes per mode (medians reported; default 11)")
    p.add_argument("--dir", default=None, help="folder for the file (default: a temporary one in the cache)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")


def checksum_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    """GB/s of each candidate checksum over one block in memory (best of `repeats`)."""
    import torch
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    candidates = {"crc32": zlib.crc32, "adler32": zlib.adler32,
                  "blake2b": lambda d: hashlib.blake2b(d).digest(), "sha256": lambda d: hashlib.sha256(d).digest()}
    out = {}
    for name, fn in candidates.items():
        best = min(_timed(fn, data) for _ in range(repeats))
        out[name] = round(nbytes / best / 1e9, 2)
    return out


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def make_store(folder: Path, total: int, block: int):
    """A file of random blocks, its layout and their checksums (what a built store holds)."""
    import torch
    from offload_engine.runtime.block_reader import chunk_checksums
    from offload_engine.runtime.layer_store import LayerLayout, StoreLayout
    path, sums = folder / "layers.bin", []
    with open(path, "wb") as f:
        for _ in range(total // block):
            data = torch.randint(0, 256, (block,), dtype=torch.uint8).numpy()
            sums.append(chunk_checksums(data))
            f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)  # out of the page cache (O_DIRECT reads bypass it anyway)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    layout = StoreLayout(tuple(LayerLayout(torch.float32, (), block) for _ in range(total // block)))
    return path, layout, tuple(sums)


def unoverlapped_reader(path: Path, layout, sums):
    """A reader checking every read the plain way: read the whole block, then checksum its
    chunks one after another on this thread."""
    from offload_engine.runtime.block_reader import BlockReader, chunk_checksums

    class Unoverlapped(BlockReader):
        def _read_checked(self, layer: int, view: memoryview) -> None:
            self._read_range(layer, view, 0, len(view))
            assert chunk_checksums(view) == list(self.checker.checksums[layer])

    return Unoverlapped(path, layout, checksums=sums, verify_every=True)


def read_pass(reader, buf, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        reader.read(i, buf)
    return time.perf_counter() - t0


def measure(path: Path, layout, sums, passes: int) -> tuple[dict[str, float], bool]:
    """(median pass seconds per mode, measured round-robin; whether reads were O_DIRECT).
    `first_cold` is the first pass of a fresh first-read reader (every block checked), `first`
    its next pass."""
    from offload_engine.runtime.layer_store import BlockReader, aligned_buffer
    n, buf = len(layout.layouts), aligned_buffer(layout.max_block)
    times: dict[str, list[float]] = {"none": [], "first_cold": [], "first": [], "every": [], "every_unoverlapped": []}
    readers = {"none": BlockReader(path, layout), "every": BlockReader(path, layout, checksums=sums, verify_every=True),
               "every_unoverlapped": unoverlapped_reader(path, layout, sums)}
    for _ in range(passes):
        fresh = BlockReader(path, layout, checksums=sums)  # a store opened anew: every block unchecked
        times["first_cold"].append(read_pass(fresh, buf, n))
        times["first"].append(read_pass(fresh, buf, n))
        assert fresh.checks == n  # the second pass checked nothing
        fresh.close()
        for mode in readers:
            times[mode].append(read_pass(readers[mode], buf, n))
    for r in readers.values():
        r.close()
    return {mode: statistics.median(t) for mode, t in times.items()}, readers["none"].direct


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args(argv)
    from offload_engine.fsutil import cache_root
    block, total = args.block_mib << 20, args.mib << 20
    load = round(os.getloadavg()[0], 2)  # at the start and the end: the machine's other work
    base = Path(args.dir) if args.dir else cache_root()
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".verify-bench-", dir=base) as tmp:
        path, layout, sums = make_store(Path(tmp), total, block)
        seconds, direct = measure(path, layout, sums, args.passes)
    result = {
        "store_bytes": layout.total_bytes, "block_bytes": block, "passes_per_mode": args.passes, "o_direct": direct,
        "pass_seconds": {k: round(v, 4) for k, v in seconds.items()},
        "read_gbps": {k: round(layout.total_bytes / v / 1e9, 3) for k, v in seconds.items()},
        "ratios": {k: round(v / seconds["none"], 3) for k, v in seconds.items() if k != "none"},
        "checksum_gbps_in_memory": checksum_gbps(),
        "cpus": os.cpu_count(), "load_average_1min": [load, round(os.getloadavg()[0], 2)],
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
