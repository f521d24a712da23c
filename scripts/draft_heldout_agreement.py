"""Top-1 agreement and KL of drafts against the embedded default target on the held-out answers
of the default draft's distillation (benchmarks/drafts/smollm2-135m-instruct/heldout.json).

    python scripts/draft_heldout_agreement.py [DRAFT ...]     (default: default)

DRAFT is `default` (the committed draft as `--draft default` runs it: rebuilt from its packed
layers) or a draft folder with the target's tokenizer and hidden size, such as the bfloat16 folder
`sequoia-offload distill` wrote. Teacher-forced, every answer position, the target resident in
float32 (about 30 s a draft on 2 CPU cores).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from offload_engine.apps.distill import DistillOptions, _Model, evaluate, load_teacher  # noqa: E402
from offload_engine.errors import UserError  # noqa: E402
from offload_engine.formats.config import load_config  # noqa: E402
from offload_engine.formats.default_model import default_model_dir  # noqa: E402
from offload_engine.speculation.drafts import DEFAULT_DRAFT, default_draft_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="*", default=["default"])
    ap.add_argument("--heldout", type=Path, default=DEFAULT_DRAFT / "heldout.json")
    args = ap.parse_args()
    records = json.loads(args.heldout.read_text())["sequences"]
    positions = sum(len(r["ids"]) - r["start"] - 1 for r in records)
    target_dir = default_model_dir()
    teacher, engine = load_teacher(target_dir, DistillOptions(offload="none"), progress=False)
    try:
        for name in args.drafts:
            folder = default_draft_dir(target_dir, progress=False) if name == "default" else Path(name)
            cfg = load_config(folder)
            if cfg.hidden_size != teacher.cfg.hidden_size or cfg.vocab_size != teacher.cfg.vocab_size:
                sys.exit(f"{folder}: hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size} must be the "
                         f"target's ({teacher.cfg.hidden_size}, {teacher.cfg.vocab_size})")
            tensors = {}
            for f in sorted(folder.glob("*.safetensors")):
                tensors.update({k: v.float() for k, v in load_file(str(f)).items()})
            kl, agree = evaluate(teacher, _Model(cfg, tensors), records, torch.device("cpu"), 8)
            print(f"{name}: {cfg.num_layers} layers, top-1 agreement {agree:.4f}, KL {kl:.3f} nats "
                  f"({len(records)} answers, {positions} positions)")
    finally:
        engine.close()


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
