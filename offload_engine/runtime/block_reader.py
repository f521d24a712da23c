"""Reading layer blocks back from the store, checked: O_DIRECT reads, each block's CRC-32s (one per
4 MiB chunk) compared with those written at build time, and the one-line errors a damaged store
or a failing disk gives.

A `BlockReader` checks a block on its first read after the store is opened, or on every read
when asked (`--verify-reads`). A checked read goes chunk by chunk, and helper threads checksum
each chunk while the next ones are read (zlib releases the GIL; chunks have their own CRCs, so
several cores can check one block at once: on a machine with idle cores the check can hide
behind the reads; on 2 busy vCPUs it did not, see docs/streaming.md). An I/O error, a short read
or a mismatch is a `DataError` naming the file, the layer and what was wrong; the caller never
gets the block.
"""

from __future__ import annotations

import errno
import os
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..errors import DataError, UserError

BLOCK_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length all multiples of this
CHECK_CHUNK = 4 << 20  # bytes per CRC: a checked read checksums one chunk while it reads the next
CHECK_THREADS = min(4, os.cpu_count() or 1)  # helpers checksumming chunks (zlib's CRC-32: ~1-3 GB/s each)


def chunk_checksums(data) -> list[int]:
    """The CRC-32 of each CHECK_CHUNK-byte chunk of a block (zlib's: 4-8x as fast as blake2b
    in this project's runs, see docs/streaming.md)."""
    return [zlib.crc32(data[i: i + CHECK_CHUNK]) for i in range(0, len(data), CHECK_CHUNK)]


def read_error(path: Path, layer: int, what: str) -> DataError:
    return DataError(f"{path}: layer {layer}: {what}; the store is damaged or the disk failing "
                     f"(delete {path.parent} to rebuild it)")


def io_error(path: Path, layer: int, e: OSError, where: str = "") -> DataError:
    return read_error(path, layer, f"I/O error{where} ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})")


class BlockChecker:
    """Checksums a block's chunks on helper threads and compares them with the written ones."""

    def __init__(self, path: Path, checksums: tuple[tuple[int, ...], ...]):
        self.path, self.checksums = path, checksums
        self.pool: ThreadPoolExecutor | None = None  # made on first use

    def submit(self, view: memoryview, start: int) -> Future:
        """Start checksumming the chunk of `view` at `start` (a multiple of CHECK_CHUNK)."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="block-check")
        return self.pool.submit(zlib.crc32, view[start: start + CHECK_CHUNK])

    def verify(self, layer: int, pending: list[Future], size: int) -> None:
        """Wait for every chunk's CRC (so no helper still reads the buffer), then compare."""
        wait(pending)
        for j, (f, expected) in enumerate(zip(pending, self.checksums[layer])):
            got, start, end = f.result(), j * CHECK_CHUNK, min((j + 1) * CHECK_CHUNK, size)
            if got != expected:
                raise read_error(self.path, layer, f"checksum mismatch in bytes {start}..{end} of {size} "
                                                   f"(read crc32 {got:08x}, written {expected:08x})")

    def check(self, layer: int, view: memoryview) -> None:
        """Check a block already read whole."""
        self.verify(layer, [self.submit(view, i) for i in range(0, len(view), CHECK_CHUNK)], len(view))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class BlockReader:
    """Reads whole layer blocks of a store file (`layout`: a StoreLayout's offsets and sizes),
    bypassing the page cache (O_DIRECT).

    Where the filesystem refuses O_DIRECT (tmpfs), it falls back to buffered reads followed by
    posix_fadvise(DONTNEED), which also keeps the page cache from serving later passes.
    Given the blocks' chunk `checksums`, it checks each block on its first read, or on every read
    with `verify_every`; `checks` counts the blocks it checked.
    """

    def __init__(self, path: Path, layout, direct: bool = True,
                 checksums: tuple[tuple[int, ...], ...] | None = None, verify_every: bool = False):
        self.path, self.offsets, self.sizes = path, layout.offsets, layout.sizes
        self.checker = BlockChecker(path, checksums) if checksums is not None else None
        self.verify_every = verify_every
        self.verified = [False] * len(self.sizes)
        self.checks = 0
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError as e:
            if not self.direct:
                raise UserError(f"{path}: cannot open the layer store ({e.strerror})") from None
            warnings.warn(f"{path}: O_DIRECT refused ({e.strerror}); using buffered reads + fadvise(DONTNEED)")
            self.direct = False
            self.fd = os.open(path, os.O_RDONLY)

    def read(self, layer: int, out: torch.Tensor) -> int:
        """Fill the head of `out` (uint8, page-aligned when direct, at least the block's size)
        with block `layer`, checked as the reader's mode says; returns the bytes the reads
        returned (what the executor counts as read from disk)."""
        size, offset = self.sizes[layer], self.offsets[layer]
        view = memoryview(out.numpy())[:size]
        if self.checker is not None and (self.verify_every or not self.verified[layer]):
            self._read_checked(layer, view)
            self.checks += 1
            self.verified[layer] = True
        else:
            self._read_range(layer, view, 0, size)
        if not self.direct:
            os.posix_fadvise(self.fd, offset, size, os.POSIX_FADV_DONTNEED)
        return size

    def _read_range(self, layer: int, view: memoryview, start: int, end: int) -> None:
        """Read bytes [start, end) of block `layer` into view[start:end], whole or a UserError."""
        offset, done = self.offsets[layer], start
        while done < end:
            try:
                n = os.preadv(self.fd, [view[done:end]], offset + done)
            except OSError as e:
                raise io_error(self.path, layer, e, f" at byte {offset + done}") from None
            if n <= 0 or (self.direct and n % BLOCK_ALIGN):  # a short O_DIRECT read: EOF
                got = done + max(n, 0)
                raise read_error(self.path, layer, f"short read ({got} of {len(view)} bytes: file truncated?)")
            done += n

    def _read_checked(self, layer: int, view: memoryview) -> None:
        """Read the block chunk by chunk, each chunk read handed to the helpers to checksum
        while the next is read; then compare (a UserError on a mismatch)."""
        pending = []
        try:
            for start in range(0, len(view), CHECK_CHUNK):
                self._read_range(layer, view, start, min(start + CHECK_CHUNK, len(view)))
                pending.append(self.checker.submit(view, start))
        finally:
            wait(pending)  # no helper still reads the buffer once it is handed back
        self.checker.verify(layer, pending, len(view))

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
