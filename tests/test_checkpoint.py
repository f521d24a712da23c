"""Checkpoint loading: sharded vs single file, and every kind of bad input refused cleanly."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_engine.apps.cli import main
from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "llama3-gqa")


def test_sharded_and_single_file_give_identical_tensors(tmp_path):
    single = make_tiny_checkpoint(tmp_path / "single", "qwen2", seed=3)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", seed=3, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, b = Checkpoint(single, load_config(single)), Checkpoint(sharded, load_config(sharded))
    assert set(a.shapes) == set(b.shapes)
    for name in a.shapes:
        assert torch.equal(a.load(name, torch.float32), b.load(name, torch.float32)), name


def test_dtype_cast_on_load(tiny):
    ckpt = Checkpoint(tiny, load_config(tiny))
    w32 = ckpt.load("model.layers.0.mlp.up_proj.weight", torch.float32)
    w16 = ckpt.load("model.layers.0.mlp.up_proj.weight", torch.bfloat16)
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))


def _run_cli(capsys, *argv):
    capsys.readouterr()  # drop what the fixtures printed
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def _assert_clean_error(code, err, *must_name):
    assert code == 2
    assert len(err) == 1 and err[0].startswith("sequoia-offload: error: "), err
    assert "Traceback" not in err[0]
    for word in must_name:
        assert word in err[0], (word, err[0])


def _generate(capsys, folder):
    return _run_cli(capsys, "generate", "--target", str(folder), "--draft", "none", "--prompt", "hi", "--max-new-tokens", "2")


def test_missing_folder(capsys, tmp_path):
    _assert_clean_error(*_generate(capsys, tmp_path / "nowhere"), "nowhere", "does not exist")


def test_folder_without_config(capsys, tmp_path):
    _assert_clean_error(*_generate(capsys, tmp_path), str(tmp_path), "config.json")


def test_unsupported_model_type(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(cfg))
    _assert_clean_error(*_generate(capsys, folder), "gpt_neox", "llama", "qwen2", "mistral")


def test_missing_shard(capsys, tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "m", "llama2-mha", max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    _assert_clean_error(*_generate(capsys, folder), shard.name, "missing")


def test_truncated_safetensors(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _assert_clean_error(*_generate(capsys, folder), "model.safetensors")


def test_tensor_shape_disagrees_with_config(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    _assert_clean_error(*_generate(capsys, folder), "mlp.gate_proj.weight", "[128, 64]", "[96, 64]")


def test_pickled_weights_are_never_loaded(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    _assert_clean_error(*_generate(capsys, folder), "safetensors")


def test_gguf_of_another_architecture(capsys, tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, err = _run_cli(capsys, "convert-gguf", str(path), str(tmp_path / "out"))
    _assert_clean_error(code, err, "gpt2.gguf", "gpt2")
    assert not (tmp_path / "out").exists()


def test_exit_status_and_no_traceback_from_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "run_70b.py"), "generate", "--target",
                           str(tmp_path / "missing"), "--prompt", "x"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"sequoia-offload: error: checkpoint folder {tmp_path / 'missing'} does not exist"]


def _edit_json(folder, name, edit):
    path = folder / name
    data = json.loads(path.read_text())
    result = edit(data)
    path.write_text(json.dumps(data if result is None else result))


BAD_CONFIGS = [
    ("hidden_act", lambda c: c.update(hidden_act="gelu"), ["gelu"]),
    ("quantised", lambda c: c.update(quantization_config={"quant_method": "fp8"}), ["fp8"]),
    ("rope no factor", lambda c: c.update(rope_parameters=None, rope_scaling={"rope_type": "llama3"}), ["factor"]),
    ("rope string", lambda c: c.update(rope_parameters=None, rope_scaling="yes"), ["rope_scaling"]),
    ("rope factor 0", lambda c: c.update(rope_parameters=None, rope_scaling={"rope_type": "linear", "factor": 0}),
     ["positive"]),
    ("eos strings", lambda c: c.update(eos_token_id=["</s>"]), ["eos_token_id"]),
    ("a list", lambda c: [c], ["config.json", "JSON object"]),
]


@pytest.mark.parametrize("name,edit,words", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_values(capsys, tmp_path, tiny, name, edit, words):
    folder = shutil.copytree(tiny, tmp_path / "m")
    _edit_json(folder, "config.json", edit)
    _assert_clean_error(*_generate(capsys, folder), *words)


def test_non_utf8_config(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    (folder / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    _assert_clean_error(*_generate(capsys, folder), "config.json", "UTF-8")


def test_tokenizer_config_that_is_a_list(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    _assert_clean_error(*_generate(capsys, folder), "tokenizer_config.json")


def test_garbage_tokenizer_json(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    (folder / "tokenizer.json").write_text("{not json")
    _assert_clean_error(*_generate(capsys, folder), "tokenizer.json")


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_weights_of_an_unsupported_dtype(capsys, tmp_path, tiny, dtype):
    from safetensors.torch import load_file, save_file
    folder = shutil.copytree(tiny, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(dtype)
    save_file(tensors, folder / "model.safetensors")
    _assert_clean_error(*_generate(capsys, folder), "model.layers.1.mlp.up_proj.weight", "F32, F16 and BF16")


BAD_FLAGS = [
    (["--device", "foo"], ["foo"]),
    (["--temperature", "nan"], ["temperature"]),
    (["--top-p", "2"], ["top_p"]),
    (["--seed", str(2**70)], ["seed"]),
    (["--max-context", "0"], ["--max-context"]),
    (["--max-new-tokens", "0"], ["max_new_tokens"]),
    (["--system", "be brief"], ["--system", "--chat"]),
    (["--dtype", "int8"], ["int8"]),
]


@pytest.mark.parametrize("flags,words", BAD_FLAGS, ids=[" ".join(f[0]) for f in BAD_FLAGS])
def test_bad_flags(capsys, tiny, flags, words):
    code, err = _run_cli(capsys, "generate", "--target", str(tiny), "--draft", "none", "--prompt", "hi", *flags)
    _assert_clean_error(code, err, *words)


def test_chat_template_that_fails_at_render(capsys, tmp_path, tiny):
    folder = shutil.copytree(tiny, tmp_path / "m")
    _edit_json(folder, "tokenizer_config.json",
               lambda c: c.update(chat_template="{{ messages[0]['content'] + 1 }}"))
    code, err = _run_cli(capsys, "generate", "--target", str(folder), "--draft", "none", "--prompt", "hi", "--chat")
    _assert_clean_error(code, err, "chat template", "TypeError")
