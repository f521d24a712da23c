"""Models by name (formats/model_names.py): Hugging Face ids found in a local hub cache and
ollama:NAME[:TAG] found through Ollama's manifests, on fake caches laid out as the real ones are
(HF: refs, snapshots of symlinks into blobs; Ollama: manifests naming sha256 blobs). A model
loaded by name must generate what the same files loaded by path generate; every broken cache is
a clear error; nothing reaches the network."""

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from offload_engine import Engine
from offload_engine.errors import UserError
from offload_engine.formats import model_names
from tiny_models import make_tiny_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hf_cache_with(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """Lay `folder`'s files out as huggingface_hub does: blobs by hash, a snapshot of relative
    symlinks, refs/<ref> holding the commit. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        digest = _sha(f)
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    return make_tiny_checkpoint(root / "a", seed=0), make_tiny_checkpoint(root / "b", seed=5)


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test."""
    def refuse(*a, **k):
        raise AssertionError(f"a connection was attempted: {a}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    import huggingface_hub.constants
    # the resolver must not rely on offline mode being set (huggingface_hub read HF_HUB_OFFLINE at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny):
    cache = tmp_path / "hub"
    hf_cache_with(cache, "acme/Tiny-Llama", tiny[0])
    hf_cache_with(cache, "acme/Tiny-Llama", tiny[1], commit=OLD_COMMIT, ref="v1")
    hf_cache_with(cache, "other/Small", tiny[1])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def greedy(target, n=8):
    with Engine.load(target, progress=False) as e:
        return e.generate("hello there", max_new_tokens=n, temperature=0.0).token_ids


def test_a_cached_hf_id_loads_its_snapshot_and_generates_as_the_folder_does(hf_cache, tiny, no_network):
    snap = model_names.resolve_name("acme/Tiny-Llama")
    assert snap == hf_cache / "models--acme--Tiny-Llama" / "snapshots" / COMMIT
    assert model_names.resolve_name("acme/Tiny-Llama@main") == snap
    assert model_names.resolve_name(f"acme/Tiny-Llama@{COMMIT}") == snap
    old = model_names.resolve_name("acme/Tiny-Llama@v1")
    assert old.name == OLD_COMMIT
    assert greedy("acme/Tiny-Llama") == greedy(tiny[0])
    assert greedy("acme/Tiny-Llama@v1") == greedy(tiny[1]) != greedy(tiny[0])


def test_hf_home_is_honoured(tmp_path, monkeypatch, tiny, no_network):
    hf_cache_with(tmp_path / "home" / "hub", "acme/Tiny-Llama", tiny[0])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert model_names.resolve_name("acme/Tiny-Llama").parent.parent == tmp_path / "home" / "hub" / \
        "models--acme--Tiny-Llama"


def test_an_id_not_in_the_cache_lists_close_matches(hf_cache, no_network):
    with pytest.raises(UserError, match=r"acme/Tiny-Lama is not in the Hugging Face cache .*close matches: "
                                        r"acme/Tiny-Llama") as e:
        model_names.resolve_name("acme/Tiny-Lama")
    assert "huggingface-cli download" in str(e.value)
    with pytest.raises(UserError, match=r"revision 'v9' of acme/Tiny-Llama is not in the Hugging Face cache"):
        model_names.resolve_name("acme/Tiny-Llama@v9")
    with pytest.raises(UserError, match="checkpoint folder|not a path|Hugging Face"):
        Engine.load("nobody/nothing", progress=False)


def test_a_broken_symlink_is_named(hf_cache, no_network):
    snap = hf_cache / "models--acme--Tiny-Llama" / "snapshots" / COMMIT
    (snap / "model.safetensors").resolve().unlink()
    with pytest.raises(UserError, match=r"acme/Tiny-Llama: 1 file\(s\) of snapshot .* point at missing blobs "
                                        r"\(model.safetensors\)"):
        model_names.resolve_name("acme/Tiny-Llama")


def test_a_snapshot_without_a_model_is_refused(hf_cache, no_network):
    repo = hf_cache / "models--acme--Docs"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "README.md").write_text("hi")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    with pytest.raises(UserError, match="neither a config.json nor a GGUF file"):
        model_names.resolve_name("acme/Docs")


def test_a_partial_download_loads_what_it_has(hf_cache, tiny, no_network):
    """`huggingface-cli download --exclude "original/*"` leaves a tree listing (trees/<commit>.json)
    that names files the snapshot lacks; huggingface_hub then raises IncompleteSnapshotError with
    local files only. The snapshot holds the model: it loads, as its folder does."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache", reason="this huggingface_hub keeps no tree "
                                     "listings, so it never reports a partial snapshot")
    repo = hf_cache / "models--acme--Tiny-Llama"
    entries = {f.name: tree_cache.TreeCacheEntry(size=f.stat().st_size, blob_id="0" * 40) for f in tiny[0].iterdir()}
    entries["original/consolidated.00.pth"] = tree_cache.TreeCacheEntry(size=10, blob_id="1" * 40)
    tree_cache.write_tree_cache(str(repo), COMMIT, entries)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError
    with pytest.raises(IncompleteSnapshotError):  # what the resolver has to get past
        snapshot_download("acme/Tiny-Llama", cache_dir=hf_cache, local_files_only=True)
    assert model_names.resolve_name("acme/Tiny-Llama") == repo / "snapshots" / COMMIT
    assert greedy("acme/Tiny-Llama") == greedy(tiny[0])


def test_a_gguf_repo_with_a_config_json_gives_its_gguf(hf_cache, ggufs, tmp_path, no_network):
    """GGUF repositories often ship a config.json beside their .gguf files and no safetensors: the
    name is the GGUF file (one of them), not a checkpoint folder that has no weights."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(ggufs[0], src / "tiny.Q8_0.gguf")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    snap = hf_cache_with(hf_cache, "acme/Tiny-GGUF", src)
    assert model_names.resolve_name("acme/Tiny-GGUF") == snap / "tiny.Q8_0.gguf"
    assert greedy("acme/Tiny-GGUF") == greedy(ggufs[0])
    shutil.copyfile(ggufs[1], src / "tiny.Q4_K_M.gguf")
    hf_cache_with(hf_cache, "acme/Two-GGUF", src)
    with pytest.raises(UserError, match=r"holds 2 GGUF files \(tiny.Q4_K_M.gguf, tiny.Q8_0.gguf\); give the path"):
        model_names.resolve_name("acme/Two-GGUF")
    (src / "tiny.Q4_K_M.gguf").unlink()
    (src / "tiny.Q8_0.gguf").unlink()
    hf_cache_with(hf_cache, "acme/Config-Only", src)
    with pytest.raises(UserError, match="has a config.json but no .safetensors weights"):
        model_names.resolve_name("acme/Config-Only")


def test_a_revision_cannot_leave_the_repository(hf_cache, no_network):
    for bad in ("acme/Tiny-Llama@../../x", "acme/Tiny-Llama@a/../b", "acme/Tiny-Llama@.hidden"):
        with pytest.raises(UserError, match="is not a revision"):
            model_names.resolve_name(bad)


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch, tiny):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme").mkdir()
    shutil.copytree(tiny[0], tmp_path / "acme" / "Tiny-Llama")
    assert not model_names.is_model_name("acme/Tiny-Llama")
    assert model_names.is_model_name("acme/Other") and model_names.is_model_name("ollama:x")


# --- Ollama -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from test_gguf import gpt2_tokenizer_meta, tiny_llama, write_gguf
    root = tmp_path_factory.mktemp("ollama_src")
    meta = gpt2_tokenizer_meta("smollm")
    vocab = len(meta["tokens"])
    return [write_gguf(root / f"m{seed}.gguf", tiny_llama(vocab, seed=seed), meta) for seed in (0, 1)]


def ollama_store(root: Path, name: str, gguf: Path | None, layers: list[dict] | None = None,
                 host="registry.ollama.ai", ns="library", tag="latest") -> Path:
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    if layers is None:
        digest = _sha(gguf)
        shutil.copyfile(gguf, root / "blobs" / f"sha256-{digest}")
        template = root / "blobs" / ("sha256-" + "1" * 64)
        template.write_text("{{ .Prompt }}")
        layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                   "size": gguf.stat().st_size},
                  {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 13}]
    manifest = root / "manifests" / host / ns / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution."
                                    "manifest.v2+json", "config": {}, "layers": layers}))
    return manifest


@pytest.fixture
def ollama(tmp_path, monkeypatch, ggufs):
    root = tmp_path / "ollama"
    ollama_store(root, "tiny", ggufs[0])
    ollama_store(root, "tiny", ggufs[1], tag="q8")
    ollama_store(root, "tiny", ggufs[1], ns="someone")
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


def test_ollama_names_follow_their_manifests_to_the_gguf_blob(ollama, ggufs, no_network):
    blob = model_names.resolve_name("ollama:tiny")
    assert blob.name == "sha256-" + _sha(ggufs[0])
    assert model_names.resolve_name("ollama:tiny:latest") == blob
    assert model_names.resolve_name("ollama:tiny:q8").name == "sha256-" + _sha(ggufs[1])
    assert model_names.resolve_name("ollama:someone/tiny").name == "sha256-" + _sha(ggufs[1])
    assert greedy("ollama:tiny") == greedy(ggufs[0])
    assert greedy("ollama:tiny:q8") == greedy(ggufs[1]) != greedy(ggufs[0])
    assert sorted(e.name for e in model_names.ollama_entries()) == ["someone/tiny:latest", "tiny:latest", "tiny:q8"]


def test_ollama_name_not_found_lists_close_matches(ollama, no_network):
    with pytest.raises(UserError, match=r"ollama:tiny:q4 is not in Ollama's models folder .*`ollama pull "
                                        r"tiny:q4`.*close matches: .*ollama:tiny:latest"):
        model_names.resolve_name("ollama:tiny:q4")
    with pytest.raises(UserError, match="give a model name"):
        model_names.resolve_name("ollama:")
    with pytest.raises(UserError, match="not an Ollama model name"):
        model_names.resolve_name("ollama:a/b/c/d")
    with pytest.raises(UserError, match="not an Ollama model name"):
        model_names.resolve_name("ollama:../x")


def test_a_missing_blob_is_named(ollama, ggufs, no_network):
    (ollama / "blobs" / ("sha256-" + _sha(ggufs[0]))).unlink()
    with pytest.raises(UserError, match=r"ollama:tiny: the weights' blob .*sha256-[0-9a-f]{64} named by .* is "
                                        r"missing"):
        model_names.resolve_name("ollama:tiny")


def test_a_manifest_without_a_gguf_model_layer_is_refused(ollama, tmp_path, no_network):
    adapter = [{"mediaType": "application/vnd.ollama.image.adapter", "digest": "sha256:" + "2" * 64, "size": 1}]
    ollama_store(ollama, "lora", None, layers=adapter)
    with pytest.raises(UserError, match=r"ollama:lora: manifest .* has 0 model layers .*its layers: "
                                        r"application/vnd.ollama.image.adapter"):
        model_names.resolve_name("ollama:lora")
    (ollama / "blobs" / ("sha256-" + "3" * 64)).write_bytes(b"PK\x03\x04 a safetensors zip, say")
    ollama_store(ollama, "st", None, layers=[{"mediaType": "application/vnd.ollama.image.model",
                                              "digest": "sha256:" + "3" * 64, "size": 30}])
    with pytest.raises(UserError, match=r"ollama:st: blob .* is not a GGUF file"):
        model_names.resolve_name("ollama:st")
    bad = ollama / "manifests" / "registry.ollama.ai" / "library" / "junk" / "latest"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    with pytest.raises(UserError, match="is not an Ollama manifest"):
        model_names.resolve_name("ollama:junk")


def test_cli_reports_a_missing_name_without_a_traceback(ollama, hf_cache, capsys, no_network):
    from offload_engine.apps.cli import main
    assert main(["generate", "--target", "ollama:nothere", "--prompt", "x", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "ollama:nothere is not in Ollama's models folder" in err and "Traceback" not in err
    assert main(["generate", "--target", "acme/Tiny-Llama", "--draft", "ollama:nothere", "--prompt", "x",
                 "--max-new-tokens", "1"]) == 2
    assert "ollama:nothere" in capsys.readouterr().err
    assert os.environ["OLLAMA_MODELS"] == str(ollama)


# --- sequoia-offload models ---------------------------------------------------------------------

def _numel(folder: Path) -> int:
    """Parameters counted from the checkpoint's own tensors (the reference for the table's count)."""
    import math

    from safetensors import safe_open
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


@pytest.fixture
def machine(tmp_path, monkeypatch, ggufs):
    """An HF cache with a target and its draft (same tokenizer) and a broken repo, an Ollama store,
    and a folder to --search."""
    from tiny_models import make_tiny_pair
    target, draft = make_tiny_pair(tmp_path / "src")
    cache = tmp_path / "hub"
    hf_cache_with(cache, "acme/Tiny-Target", target)
    hf_cache_with(cache, "acme/Tiny-Draft", draft)
    snap = hf_cache_with(cache, "acme/Broken", target)
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / ("0" * 64))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    root = tmp_path / "ollama"
    ollama_store(root, "tiny", ggufs[0])
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    extra = tmp_path / "mine"
    shutil.copytree(draft, extra / "deep" / "copy")
    shutil.copyfile(ggufs[1], extra / "other.gguf")
    return {"target": target, "draft": draft, "search": extra}


def test_models_lists_every_source_with_sizes_and_pairs(machine, capsys, no_network):
    from offload_engine.apps.cli import main
    assert main(["models", "--json", "--search", str(machine["search"])]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {m["name"]: m for m in out["models"]}
    copy = str(machine["search"] / "deep" / "copy")
    assert {"default", "acme/Tiny-Target", "acme/Tiny-Draft", "ollama:tiny:latest", copy,
            str(machine["search"] / "other.gguf"), "acme/Broken"} <= set(rows)
    t = rows["acme/Tiny-Target"]
    assert t["params"] == _numel(machine["target"]) and t["family"] == "llama"
    assert t["disk_bytes"] == sum(f.stat().st_size for f in machine["target"].glob("*.safetensors"))
    assert t["format"] == "safetensors f32" and abs(t["bits_per_weight"] - 32) < 0.5
    assert t["drafts"] == ["acme/Tiny-Draft", copy] or t["drafts"] == [copy, "acme/Tiny-Draft"]
    assert rows["acme/Tiny-Draft"]["drafts"] == []  # a draft never drafts for a larger model
    assert "acme/Tiny-Target" not in rows["ollama:tiny:latest"]["drafts"]  # another tokenizer
    assert rows["ollama:tiny:latest"]["format"].startswith("GGUF ") and rows["ollama:tiny:latest"]["params"] > 0
    assert rows["default"]["drafts"][0] == "default" and rows["default"]["params"] > 100e6
    assert "point at missing blobs" in rows["acme/Broken"]["error"]
    assert sum(t["layers"].values()) == 3 and t["plain_s_per_token"] is None  # no GPU here: no prediction
    assert "give --gpu" in out["note"]


def test_models_predicts_on_a_spec_sheet_gpu(machine, capsys, no_network):
    from offload_engine.apps.cli import main
    from offload_engine.formats.config import load_config
    from offload_engine.planning import simulator
    assert main(["models", "--json", "--gpu", "rtx4090", "--ram", "64GiB"]) == 0
    rows = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    t = rows["acme/Tiny-Target"]
    assert t["layers"] == {"device": 3, "ram": 0, "disk": 0}
    assert t["draft"] == "acme/Tiny-Draft" and t["tree"].startswith("(")
    sim = simulator.simulate("rtx4090", 64 * 2**30, load_config(machine["target"]), load_config(machine["draft"]))
    assert t["tree_s_per_token"] == pytest.approx(sim.choice.seconds_per_token)
    assert t["plain_s_per_token"] == pytest.approx(sim.plain_seconds_per_token)


def test_models_table_names_what_is_not_usable(machine, capsys, no_network):
    from offload_engine.apps.cli import main
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["NAME", "FAMILY", "PARAMS", "FORMAT"]
    assert "acme/Tiny-Target" in out and "not usable:" in out and "acme/Broken: " in out
    assert main(["models", "--search", str(machine["search"] / "nothere")]) == 2
    assert "--search" in capsys.readouterr().err


def test_drafts_pair_only_with_the_same_embedding_size():
    """Qwen2.5's 0.5B and 7B share a tokenizer but not their vocab_size (151936, 152064): the
    engine refuses such a pair, so `models` must not offer it."""
    from types import SimpleNamespace

    from offload_engine.apps.models import ModelRow, pair_drafts
    big = ModelRow("big", "hf", params=7_000_000_000, tokenizer="t", _cfg=SimpleNamespace(vocab_size=152064))
    other = ModelRow("other", "hf", params=500_000_000, tokenizer="t", _cfg=SimpleNamespace(vocab_size=151936))
    same = ModelRow("same", "hf", params=1_000_000_000, tokenizer="t", _cfg=SimpleNamespace(vocab_size=152064))
    pair_drafts([big, other, same])
    assert big.drafts == ["same"] and big._draft_row is same
