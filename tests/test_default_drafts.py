"""The embedded default pair's drafts, on the real model: every draft gives exactly the target's
greedy answer, the committed distilled draft is the trained one (it agrees with the target far
more often than the untrained early exit it started from), and the stored acceptance vectors
exist for every draft at T=0 and T=0.6 and are what --tree sequoia uses."""

import json
import re

import pytest

from offload_engine import Engine
from offload_engine.speculation.acceptance_store import STORE_DIR
from offload_engine.speculation.drafts import DEFAULT_DRAFT

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Give me three tips for learning a new language."}]
DRAFTS = ["default", "self-int8", "self-int4"]


@pytest.fixture(scope="module")
def plain():
    engine = Engine.load("default", device="cpu", progress=False)
    return engine.generate(messages=QUESTION, max_new_tokens=48).token_ids


# tokens per step at budget 32 on this prompt, floors well under what was measured (self-int8
# and self-int4 ~5-7; the distilled draft, whose top-1 agreement is ~0.3, ~1.5-1.9)
MIN_TOKENS_PER_STEP = {"default": 1.15, "self-int8": 2.5, "self-int4": 2.0, "self-q8": 2.5}


# self-q8 (the substitute self-draft) with the target streamed from disk, as the demo runs it: every
# layer streamed, so every draft layer is its int8 copy, and trees are grown while passes wait
@pytest.mark.parametrize("draft,offload", [(d, None) for d in DRAFTS] + [("self-q8", "disk")])
def test_greedy_with_each_default_draft_equals_plain(plain, draft, offload):
    engine = Engine.load("default", device="cpu", tree="sequoia", draft=draft, tree_budget=32, tree_depth=8,
                         progress=False, **({"offload": offload} if offload else {}))
    result = engine.generate(messages=QUESTION, max_new_tokens=48)
    assert result.token_ids == plain
    s = result.stats
    assert s["acceptance_source"].startswith("smollm2-135m-instruct__")  # the stored vector shaped the tree
    assert s["tokens_per_step"] > MIN_TOKENS_PER_STEP[draft], s  # a useful draft, not merely an exact one


def test_stored_vectors_cover_every_draft_and_temperature():
    """... measured the way the planner uses them and of today's drafts (the vectors of 2026-11-30
    read self-int8's first rank at 0.972 where today's reads 0.94): deep measuring trees, every
    node of each accepted path counted, and for a substitute draft every layer streamed, as the
    demo runs it (its key has no -r<n>: with --offload none it is another draft)."""
    engine = Engine.load("default", device="cpu", tree="sequoia", draft="self-int8", progress=False)
    for draft in DRAFTS + ["self-q8", "self-q4"]:
        for t in ("0", "0.6"):
            path = STORE_DIR / f"smollm2-135m-instruct__{draft}__t{t}.json"
            data = json.loads(path.read_text())
            assert data["target_fingerprint"] == engine.target_fingerprint, path
            assert data["prompts"] >= 40 and data["width"] >= 8 and data["mode"] == "on-policy"
            assert data.get("depth", 2) >= 3 and data["rank_evidence"]["at_risk"][0] >= 1000, path
            key = data["draft_key"]
            # (no -r<n>: every layer a substitute, as the demo streams them)
            assert key.startswith("model:") if draft == "default" else re.fullmatch(rf"{draft}(-g\d+)?", key), path


def test_committed_draft_is_the_trained_one_small_and_documented():
    """Top-1 agreement with the target's greedy answers to 4 held-out prompts, teacher-forced:
    the committed 12-layer draft (int4-packed, as rebuilt) measured 0.36 here (69 of 192 answer
    tokens; 0.43 on its distillation's held-out answers); its starting point (the target's first 12
    layers, untrained) 0.09 on those answers. The floor 0.20 sits between them, about four standard
    errors (0.035 at 192 positions) under what was measured."""
    import torch
    from offload_engine.formats.checkpoint import Checkpoint
    from offload_engine.formats.config import load_config
    from offload_engine.runtime.model import Transformer
    from offload_engine.speculation.drafts import default_draft_dir
    assert (DEFAULT_DRAFT / "layers.safetensors").stat().st_size <= 25 * 2**20
    assert "sequoia-offload distill" in (DEFAULT_DRAFT / "README.md").read_text()
    target = Engine.load("default", device="cpu", progress=False)
    folder = default_draft_dir(target.folder, progress=False)
    ckpt = Checkpoint(folder, load_config(folder))
    draft = Transformer.from_checkpoint(ckpt, torch.float32)
    ckpt.close()
    prompts = [json.loads(line)["messages"] for line in
               (DEFAULT_DRAFT.parent.parent / "prompts.jsonl").read_text().splitlines()[20:24]]
    agree = total = 0
    for messages in prompts:
        ids = target.tokenizer.encode_chat(messages)
        answer = target.generate(input_ids=ids, max_new_tokens=48).token_ids
        seq = torch.tensor(ids + answer)
        logits = [m.forward(seq, torch.arange(len(seq)), m.new_cache(len(seq))) for m in (target.model, draft)]
        rows = slice(len(ids) - 1, len(seq) - 1)
        agree += int((logits[0][rows].argmax(-1) == logits[1][rows].argmax(-1)).sum())
        total += len(answer)
    assert agree / total > 0.20, agree / total
