"""Stored acceptance vectors: found by the pair's fingerprints, the nearest temperature shapes
`--tree sequoia`, and what the `acceptance` command writes is what the store reads."""

import json

import pytest

from offload_engine import Engine
from offload_engine.apps.cli import main
from offload_engine.formats.checkpoint import fingerprint
import offload_engine.speculation.acceptance_store as store
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    a = make_tiny_checkpoint(root / "a", "llama3-gqa", layers=2, seed=1, init_std=0.05)
    b = make_tiny_checkpoint(root / "b", "llama3-gqa", layers=2, seed=2, init_std=0.05)
    return a, b


def test_fingerprint_tells_weights_apart(models, tmp_path):
    import shutil
    a, b = models
    assert fingerprint(a) == fingerprint(a)
    assert fingerprint(a) != fingerprint(b)  # same config and tokenizer, other weights
    shutil.copytree(a, tmp_path / "moved")
    assert fingerprint(tmp_path / "moved") == fingerprint(a)  # the folder does not matter


def _write(folder, name, target_fp, key, temperature, probs):
    (folder / name).write_text(json.dumps({"acceptance": probs, "temperature": temperature,
                                           "target_fingerprint": target_fp, "draft_key": key}))


def test_nearest_stored_vector_shapes_sequoia(models, tmp_path, monkeypatch):
    a, b = models
    monkeypatch.setattr(store, "STORE_DIR", tmp_path)
    fp = fingerprint(a)
    _write(tmp_path, "cold.json", fp, "self-int8", 0.0, [0.9, 0.05])
    _write(tmp_path, "warm.json", fp, "self-int8", 0.6, [0.5, 0.2, 0.1, 0.05])
    _write(tmp_path, "other-draft.json", fp, "self-int4-g64", 0.3, [0.1])
    _write(tmp_path, "other-target.json", fingerprint(b), "self-int8", 0.3, [0.1])
    (tmp_path / "junk.json").write_text("[1, 2]")
    engine = Engine.load(a, tree="sequoia", draft="self-int8", tree_budget=12, tree_depth=5, progress=False)
    assert sorted(engine.stored_acceptance) == [0.0, 0.6]
    got = {t: engine.generate("Hello", max_new_tokens=8, temperature=t, seed=0).stats for t in (0.0, 0.2, 0.4, 1.0)}
    assert got[0.0]["acceptance_source"].startswith("cold.json") and len(got[0.0]["acceptance_by_rank"]) == 2
    assert got[0.2]["acceptance_source"].startswith("cold.json")
    assert got[0.4]["acceptance_source"].startswith("warm.json") and len(got[0.4]["acceptance_by_rank"]) == 4
    assert got[1.0]["acceptance_source"].startswith("warm.json")
    # a stored vector too narrow for the budget and depth is left out (with a warning), not a crash
    _write(tmp_path, "narrow.json", fp, "self-int8", 0.3, [0.9, 0.05])
    wide = Engine.load(a, tree="sequoia", draft="self-int8", tree_budget=40, tree_depth=4, progress=False)
    assert sorted(wide.stored_acceptance) == [0.6]  # 2 children per node fill at most 15 nodes in 4 levels
    (tmp_path / "narrow.json").unlink()
    # a vector given explicitly wins; another draft has none stored
    from sequoia_trees.acceptance import AcceptanceVector
    given = Engine.load(a, tree="sequoia", draft="self-int8", acceptance=AcceptanceVector((0.5, 0.3, 0.1)), progress=False)
    assert given.generate("Hello", max_new_tokens=4).stats["acceptance_source"] == "given"
    other = Engine.load(a, tree="sequoia", draft=b, progress=False)
    assert other.generate("Hello", max_new_tokens=4).stats["acceptance_source"] == "generic"


def test_acceptance_command_output_is_found_by_the_store(models, tmp_path, monkeypatch):
    a, b = models
    monkeypatch.setattr(store, "STORE_DIR", tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nThe capital of France is\n")
    out = tmp_path / "measured.json"
    assert main(["acceptance", "--target", str(a), "--draft", str(b), "--prompts", str(prompts), "--out", str(out),
                 "--width", "3", "--max-new-tokens", "6", "--temperature", "0.6"]) == 0
    data = json.loads(out.read_text())
    assert data["target_fingerprint"] == fingerprint(a)
    assert data["draft_key"] == "model:" + fingerprint(b)
    engine = Engine.load(a, tree="sequoia", draft=b, progress=False)
    assert list(engine.stored_acceptance) == [0.6]
    assert engine.generate("Hi", max_new_tokens=4).stats["acceptance_source"].startswith("measured.json")
