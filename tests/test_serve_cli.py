"""`sequoia-offload serve` as a user starts it: a separate process on 127.0.0.1, stopped with
Ctrl-C; a tiny checkpoint here, the embedded default pair (speculating) in the slow test."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from offload_engine.apps.cli import main
from tiny_models import make_tiny_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`serve` in a child process; what it prints goes to a pipe read at stop(), or to the file
    `log` (a server answering thousands of requests would fill a pipe with its access log)."""

    def __init__(self, args, env=None, timeout=180, log=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        out = open(log, "w") if log else subprocess.PIPE
        self.proc = subprocess.Popen([sys.executable, "-m", "offload_engine.apps.cli", "serve", "--port", str(self.port),
                                      *args], stdout=out, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        if log:
            out.close()  # the child has its own copy
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if json.loads(r.read())["status"] == "ok":
                        return
            except OSError:
                time.sleep(0.2)

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, as a user stops it; (exit status, everything it printed)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            pytest.fail("the server did not stop on Ctrl-C:\n" + (out or self.output()))
        return self.proc.returncode, out or self.output()

    def output(self) -> str:
        """What the process printed, once it has exited (or so far, with `log`)."""
        return Path(self.log).read_text() if self.log else self.proc.stdout.read()


def test_serve_binds_localhost_takes_the_key_from_the_environment_and_stops_on_ctrl_c(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "my-model", "smollm-tied", init_std=0.2)
    server = ServeProcess(["--target", str(folder), "--draft", "none", "--max-queue", "3"], env={"SEQUOIA_OFFLOAD_API_KEY": "s3cret"})
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + "/v1/models", timeout=10)
        assert e.value.code == 401
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["my-model"]  # the folder's name
        r = client.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0)
        assert r.usage.completion_tokens >= 1
        with urllib.request.urlopen(server.url + "/health", timeout=10) as h:
            assert json.loads(h.read())["max_queue"] == 3
    finally:
        code, out = server.stop()
    assert code == 0, out
    assert f"serving 'my-model' at http://127.0.0.1:{server.port}/v1" in out


@pytest.mark.parametrize("flags,message", [
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--max-body", "0"], "--max-body must be at least 1 byte"),
    (["--body-timeout", "0"], "--body-timeout must be more than 0 seconds"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0 lets other machines connect: give --api-key KEY"),
    (["--host", "192.168.1.20"], "or --insecure-no-key to serve them without one"),
])
def test_serve_flag_errors_are_one_line(flags, message, capsys):
    assert main(["serve", "--target", "default", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_default_pair_served_speculating_two_turns_reuse_the_cache():
    """The embedded default target with its distilled draft and a Sequoia tree behind the API:
    the right answer, streamed text equal to non-streamed text, and a second turn that prefills
    only its new message."""
    server = ServeProcess(["--draft", "default", "--tree", "sequoia", "--tree-budget", "16", "--tree-depth", "4"],
                          timeout=600)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        history = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=48,
                                                     stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        first = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=48)
        answer = first.choices[0].message.content
        assert answer == streamed and "Paris" in answer and first.choices[0].finish_reason == "stop"
        assert first.sequoia["tree"] == "sequoia" and first.sequoia["tokens_per_step"] > 1.0
        assert first.sequoia["trees"] is None  # a fixed tree: only --tree auto lists the trees its steps used
        history += [{"role": "assistant", "content": answer},
                    {"role": "user", "content": "And what is the capital of Italy?"}]
        second = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=48)
        assert "Rome" in second.choices[0].message.content
        cached = second.usage.prompt_tokens_details.cached_tokens
        new_tokens = second.usage.prompt_tokens - (first.usage.prompt_tokens + first.usage.completion_tokens)
        # everything of the first turn (prompt and answer) came from the cache; only the new
        # message (and at most the answer's last token, never fed back) was prefilled
        assert second.usage.prompt_tokens - cached <= new_tokens + 1, (cached, new_tokens)
        assert second.sequoia["prefilled_tokens"] == second.usage.prompt_tokens - cached
    finally:
        code, out = server.stop()
    assert code == 0, out
