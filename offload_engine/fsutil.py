"""Crash safety for folders written under a temporary name and renamed into place."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

STALE_TEMP_SECONDS = 3600  # a temporary folder older than this was left by a dead process


def remove_stale_temps(folder: Path, pattern: str) -> None:
    """Delete temporary folders matching `pattern` in `folder` that no live build still writes."""
    now = time.time()
    for p in folder.glob(pattern):
        try:
            if now - p.stat().st_mtime > STALE_TEMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
