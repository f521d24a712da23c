"""The interactive chat loop: history through the template, /reset, /stats, streamed answers."""

import json

import pytest

from offload_engine import Engine
from offload_engine.apps.cli import main
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
    assert main(["chat", "--target", str(folder), "--draft", "none", "--max-new-tokens", "6", "--system", "be brief"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 3
    system = {"role": "system", "content": "be brief"}
    assert calls[0][:2] == [system, {"role": "user", "content": "first question"}]
    assert calls[1][:4] == calls[0] + [{"role": "user", "content": "second question"}]
    assert calls[2][:2] == [system, {"role": "user", "content": "third question"}]  # after /reset
    for turn in calls:
        assert turn[-1]["content"].strip() and turn[-1]["content"] in out  # each answer was printed (streamed) in full
    start = out.index("\n{\n") + 1
    stats_json = out[start: out.index("\n}", start) + 2]
    assert json.loads(stats_json)["new_tokens"] >= 1
    assert "(history cleared)" in out


def test_chat_ends_cleanly_at_end_of_input(folder, monkeypatch):
    def eof(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    assert main(["chat", "--target", str(folder), "--draft", "none"]) == 0


def test_a_stats_line_follows_each_answer_and_later_turns_reuse_the_cache(folder, monkeypatch, capsys):
    lines = iter(["first question", "second question", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--target", str(folder), "--draft", "none", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    stats = [line for line in out.splitlines() if line.startswith("[") and "tokens/s" in line]
    assert len(stats) == 2 and all("token/step" in s or "tokens/step" in s for s in stats), stats
    assert "cached from the previous turn" not in stats[0]
    assert "cached from the previous turn" in stats[1]  # the first turn's prompt was not prefilled again


def test_ctrl_c_stops_the_answer_and_keeps_the_session_and_its_cache(folder, monkeypatch, capsys):
    lines = iter(["first question", "second question", "/stats", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    calls = []
    real = Engine.generate

    def interrupted_first(self, *args, **kwargs):
        calls.append([dict(m) for m in kwargs["messages"]])
        if len(calls) == 1:  # Ctrl-C arrives while the third token is being shown
            shown, inner = [], kwargs["on_token"]

            def on_token(token_id, text):
                inner(token_id, text)
                shown.append(token_id)
                if len(shown) == 3:
                    raise KeyboardInterrupt
            kwargs["on_token"] = on_token
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", interrupted_first)
    assert main(["chat", "--target", str(folder), "--draft", "none", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "(stopped)" in out and len(calls) == 2
    # the partial answer stays in the history, and the next turn builds on it
    assert calls[1][0] == {"role": "user", "content": "first question"} and calls[1][1]["role"] == "assistant"
    assert calls[1][2] == {"role": "user", "content": "second question"}
    start = out.index("\n{\n") + 1  # /stats prints the last answer's stats as indented JSON
    last = json.loads(out[start: out.index("\n}", start) + 2])
    assert last["cached_prompt_tokens"] > 0  # the interrupted turn's cache was still good to reuse


def test_the_auto_summary_says_what_its_speed_up_stands_on():
    """The stats line's speed-up over plain decoding is against this run's plain steps, and it
    says how many (one step on a disk whose speed moves is a noisy yardstick); with none, against
    plain's time predicted from the run's steps."""
    from offload_engine.apps.cli import _auto_summary
    auto = {"budget": 12, "depth": 12, "trees": "(12,12) x 6 steps, plain x 1", "adapt": True,
            "predicted_seconds_per_token": 0.124, "forecast_seconds_per_token": 0.123,
            "measured_plain_seconds_per_token": 0.15, "plain_steps": 1, "adapted_plain_seconds_per_token": 0.13,
            "predicted_speedup": 1.04}
    line = _auto_summary({"decode_tokens_per_second": 10.0}, auto)
    assert "1.50x over plain streamed decoding (0.150 s/token, 1 plain step measured here; 1.04x predicted" in line
    line = _auto_summary({"decode_tokens_per_second": 10.0}, {**auto, "plain_steps": 3})
    assert "(0.150 s/token, median of 3 plain steps measured here" in line
    line = _auto_summary({"decode_tokens_per_second": 10.0},
                         {**auto, "plain_steps": 0, "measured_plain_seconds_per_token": None})
    assert "1.30x over plain streamed decoding (0.130 s/token, predicted from this run's steps" in line
    # the demo's yardstick (plain steps timed after the answer) replaces the run's own plain steps
    line = _auto_summary({"decode_tokens_per_second": 10.0}, auto, (0.12, "median of 8 plain steps timed after"))
    assert "1.20x over plain streamed decoding (0.120 s/token, median of 8 plain steps timed after; 1.04x" in line
