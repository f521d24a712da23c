"""The hostile suite's figures: write_report(part, figures) merges them into
$HOSTILE_REPORT_DIR/<part>.json when that variable is set, else does nothing (docs/hostile.md is
made from these files)."""

import json
import os
from pathlib import Path


def write_report(part: str, figures: dict) -> None:
    folder = os.environ.get("HOSTILE_REPORT_DIR")
    if not folder:
        return
    path = Path(folder) / f"{part}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
