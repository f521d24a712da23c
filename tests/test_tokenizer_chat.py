"""Tokenizer and chat template: control tokens, the sandbox, and a checkpoint without a template."""

import json
import shutil

import pytest

from offload_engine import UserError
from offload_engine.apps.cli import main
from offload_engine.formats.tokenizer import Tokenizer
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "m", "smollm-tied")


def test_chat_template_renders_and_control_tokens_are_single_ids(folder):
    tok = Tokenizer.from_folder(folder)
    messages = [{"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(messages)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert ids.count(start) == 2 and ids.count(end) == 1 and ids[0] == start
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append(1) %}{{ x }}",
])
def test_chat_template_is_sandboxed(folder, tmp_path, template):
    copy = shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_folder(copy)
    with pytest.raises(UserError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_raise_exception_in_template_is_a_user_error(folder, tmp_path):
    copy = shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="first must be user"):
        Tokenizer.from_folder(copy).apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_without_template_is_refused_cleanly(folder, tmp_path, capsys):
    copy = shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    code = main(["generate", "--target", str(copy), "--draft", "none", "--prompt", "hi", "--chat"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "no chat template" in err[0] and str(copy) in err[0]


def test_generate_json_prints_one_object_and_nothing_else(folder, capsys):
    capsys.readouterr()
    assert main(["generate", "--target", str(folder), "--draft", "none", "--prompt", "Hello", "--chat", "--max-new-tokens", "5",
                 "--json"]) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)
    assert out.count("\n") == 1 and set(obj) == {"text", "token_ids", "stats"}
    for key in ("prompt_tokens", "new_tokens", "seconds", "tokens_per_second"):
        assert key in obj["stats"]
    assert 1 <= len(obj["token_ids"]) <= 5
