"""Where files live (the cache folder, the installed data) and crash safety for files and
folders written under a temporary name and renamed into place. Every layer uses it."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

STALE_TEMP_SECONDS = 3600  # a temporary folder older than this was left by a dead process
# the folder holding offload_engine/, hw_profiles/ and benchmarks/: the repository, or site-packages
INSTALL_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(__file__).resolve().parent / "data"  # package data (the default prompt list)


def cache_root() -> Path:
    """$XDG_CACHE_HOME/sequoia-offload, else ~/.cache/sequoia-offload."""
    base = os.environ.get("XDG_CACHE_HOME")
    root = Path(base) if base else Path.home() / ".cache"
    return root / "sequoia-offload"


def remove_stale_temps(folder: Path, pattern: str) -> None:
    """Delete temporary folders (or files) matching `pattern` in `folder` that no live build
    still writes."""
    now = time.time()
    for p in folder.glob(pattern):
        try:
            if now - p.stat().st_mtime > STALE_TEMP_SECONDS:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()
        except OSError:
            pass


def fsync_path(path: str | os.PathLike) -> None:
    """Put a file's bytes, or a folder's entries, on the disk (what a power cut keeps)."""
    folder = os.path.isdir(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if folder else 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (9p, vboxsf, CIFS) cannot sync a folder: its rename stands
        if not folder or e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync a file, or every file under a folder and then every folder, deepest first: called
    before a rename publishes it, so that a power cut never leaves the final name over empty files
    (the rename itself is made durable by fsyncing the folder that holds the new name)."""
    if not os.path.isdir(path):
        fsync_path(path)
        return
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file beside it, synced, renamed into place,
    and the rename synced (temporaries a killed process left are swept after STALE_TEMP_SECONDS)."""
    remove_stale_temps(path.parent, f".{path.name}.tmp-*")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
