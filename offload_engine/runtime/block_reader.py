"""Reading layer blocks back from the store, checked: O_DIRECT reads, each block's CRC-32 compared
with the one written at build time, and the one-line errors a damaged store or a failing disk gives.

A `BlockReader` checks a block on its first read after the store is opened, or on every read
when asked (`--verify-reads`). A checked read goes in chunks, and a helper thread checksums each
chunk while the next one is read (zlib releases the GIL), so the check costs only what it takes
beyond the read itself. An I/O error, a short read or a mismatch is a `UserError` naming the file,
the layer and what was wrong; the caller never gets the block.
"""

from __future__ import annotations

import errno
import os
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import UserError

BLOCK_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length all multiples of this
CHECK_CHUNK = 4 << 20  # a checked read's chunks: one is checksummed while the next is read


def block_checksum(data, start: int = 0) -> int:
    """CRC-32 of a block's bytes, continuing from `start` (zlib's: 1.6 GB/s on this project's
    2-vCPU machine, 4x blake2b; measured by benchmarks/verify_reads.py)."""
    return zlib.crc32(data, start)


def read_error(path: Path, layer: int, what: str) -> UserError:
    return UserError(f"{path}: layer {layer}: {what}; the store is damaged or the disk failing "
                     f"(delete {path.parent} to rebuild it)")


def io_error(path: Path, layer: int, e: OSError, where: str = "") -> UserError:
    return read_error(path, layer, f"I/O error{where} ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})")


def check_block(path: Path, layer: int, data, expected: int | None, got: int | None = None) -> None:
    """Raise a UserError naming the file and layer when `data` (whose CRC-32 is `got`, when
    already known) is not the block that was written."""
    if expected is None:
        return
    got = block_checksum(data) if got is None else got
    if got != expected:
        raise read_error(path, layer, f"checksum mismatch (read crc32 {got:08x}, written {expected:08x})")


class BlockReader:
    """Reads whole layer blocks of a store file (`layout`: a StoreLayout's offsets and sizes),
    bypassing the page cache (O_DIRECT).

    Where the filesystem refuses O_DIRECT (tmpfs), it falls back to buffered reads followed by
    posix_fadvise(DONTNEED), which also keeps the page cache from serving later passes.
    Given the blocks' `checksums`, it checks each block on its first read, or on every read with
    `verify_every`; `checks` counts the blocks it checksummed.
    """

    def __init__(self, path: Path, layout, direct: bool = True,
                 checksums: tuple[int, ...] | None = None, verify_every: bool = False):
        self.path, self.offsets, self.sizes = path, layout.offsets, layout.sizes
        self.checksums, self.verify_every = checksums, verify_every
        self.verified = [False] * len(self.sizes)
        self.checks = 0
        self._checker: ThreadPoolExecutor | None = None  # made on the first checked read
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
        if self.checksums is not None and (self.verify_every or not self.verified[layer]):
            check_block(self.path, layer, view, self.checksums[layer], self._read_checksummed(layer, view))
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

    def _read_checksummed(self, layer: int, view: memoryview) -> int:
        """Read the block chunk by chunk, the helper thread checksumming each chunk read (in
        order: it has one worker) while this one reads the next; returns the block's CRC-32."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="block-check")
        crc, last = [0], None

        def feed(chunk: memoryview) -> None:
            crc[0] = block_checksum(chunk, crc[0])

        try:
            for start in range(0, len(view), CHECK_CHUNK):
                end = min(start + CHECK_CHUNK, len(view))
                self._read_range(layer, view, start, end)
                last = self._checker.submit(feed, view[start:end])
        finally:
            if last is not None:  # the helper never reads a buffer that was handed back
                last.result()
        return crc[0]

    def close(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=True)
            self._checker = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
