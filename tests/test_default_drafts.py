"""The embedded default pair's drafts, on the real model: every draft gives exactly the target's
greedy answer, the committed distilled draft loads and beats a trivial agreement floor, and the
stored acceptance vectors exist for every draft at T=0 and T=0.6 and are what --tree sequoia uses."""

import json

import pytest

from offload_engine import Engine
from offload_engine.acceptance_store import STORE_DIR
from offload_engine.drafts import DEFAULT_DRAFT

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Give me three tips for learning a new language."}]
DRAFTS = ["default", "self-int8", "self-int4"]


@pytest.fixture(scope="module")
def plain():
    engine = Engine.load("default", device="cpu", progress=False)
    return engine.generate(messages=QUESTION, max_new_tokens=48).token_ids


@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_with_each_default_draft_equals_plain(plain, draft):
    engine = Engine.load("default", device="cpu", draft=draft, tree_budget=32, tree_depth=8, progress=False)
    result = engine.generate(messages=QUESTION, max_new_tokens=48)
    assert result.token_ids == plain
    s = result.stats
    assert s["acceptance_source"].startswith("smollm2-135m-instruct__")  # the stored vector shaped the tree
    assert s["tokens_per_step"] > 1.5, s  # a draft that agrees often, not merely an exact one


def test_stored_vectors_cover_every_draft_and_temperature():
    engine = Engine.load("default", device="cpu", draft="self-int8", progress=False)
    for draft in DRAFTS:
        for t in ("0", "0.6"):
            path = STORE_DIR / f"smollm2-135m-instruct__{draft}__t{t}.json"
            data = json.loads(path.read_text())
            assert data["target_fingerprint"] == engine.target_fingerprint, path
            assert data["prompts"] >= 40 and data["width"] >= 8 and data["mode"] == "on-policy"


def test_committed_draft_is_small_and_documented():
    size = (DEFAULT_DRAFT / "layers.safetensors").stat().st_size
    assert size <= 25 * 2**20
    report = json.loads((DEFAULT_DRAFT / "distill.json").read_text())
    assert report["final_agreement"] >= 0.40  # held-out top-1 agreement, the floor
    assert "sequoia-offload distill" in (DEFAULT_DRAFT / "README.md").read_text()
