"""Write the committed form of the default pair's distilled draft into
benchmarks/drafts/smollm2-135m-instruct/: its layers and final norm (layers.safetensors), its
config, the distillation report, and the digest of the target embeddings it shares.

    python scripts/pack_default_draft.py DISTILLED_FOLDER
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload_engine.drafts import DEFAULT_DRAFT, pack_default_draft  # noqa: E402

if __name__ == "__main__":
    pack_default_draft(Path(sys.argv[1]))
    print(f"packed {sys.argv[1]} -> {DEFAULT_DRAFT}")
