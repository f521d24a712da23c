"""The interactive chat loop: history through the template, /reset, /stats, streamed answers."""

import json

import pytest

from offload_engine import Engine
from offload_engine.cli import main
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("chat") / "m", "smollm-tied", init_std=0.2)


def test_chat_keeps_history_resets_and_reports_stats(folder, monkeypatch, capsys):
    lines = iter(["first question", "/stats", "second question", "/reset", "third question", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    calls = []
    real = Engine.generate

    def spy(self, *args, **kwargs):
        calls.append([dict(m) for m in kwargs["messages"]])
        result = real(self, *args, **kwargs)
        calls[-1].append({"role": "assistant", "content": result.text})
        return result

    monkeypatch.setattr(Engine, "generate", spy)
    assert main(["chat", "--target", str(folder), "--max-new-tokens", "6", "--system", "be brief"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 3
    system = {"role": "system", "content": "be brief"}
    assert calls[0][:2] == [system, {"role": "user", "content": "first question"}]
    assert calls[1][:4] == calls[0] + [{"role": "user", "content": "second question"}]
    assert calls[2][:2] == [system, {"role": "user", "content": "third question"}]  # after /reset
    for turn in calls:
        assert turn[-1]["content"].strip() and turn[-1]["content"] in out  # each answer was printed (streamed) in full
    stats_json = out[out.index("{"): out.index("}") + 1]
    assert json.loads(stats_json)["new_tokens"] >= 1
    assert "(history cleared)" in out


def test_chat_ends_cleanly_at_end_of_input(folder, monkeypatch):
    def eof(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    assert main(["chat", "--target", str(folder)]) == 0
