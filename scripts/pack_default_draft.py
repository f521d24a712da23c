"""Write the committed form of the default pair's distilled draft into
benchmarks/drafts/smollm2-135m-instruct/: its layers and final norm (layers.safetensors), its
config, the distillation report, and the digest of the target embeddings it shares.

    python scripts/pack_default_draft.py DISTILLED_FOLDER [--weights int8|int4|same] [--group-size 64]

int8 (the default) fits about 7 layers of SmolLM2-135M in the 25 MB a committed draft may take;
int4 about 12.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload_engine.runtime.quant import DEFAULT_GROUP_SIZE  # noqa: E402
from offload_engine.speculation.drafts import DEFAULT_DRAFT, pack_default_draft  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("distilled", type=Path)
    ap.add_argument("--weights", default="int8", choices=("int8", "int4", "same"))
    ap.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                    help=f"int4: inputs per group (default {DEFAULT_GROUP_SIZE})")
    args = ap.parse_args()
    pack_default_draft(args.distilled, weights=args.weights, group_size=args.group_size)
    print(f"packed {args.distilled} ({args.weights}) -> {DEFAULT_DRAFT}")
