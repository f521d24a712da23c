"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` package (and
by raw HTTP where a client library would refuse to send the bad request): chat and completions,
streamed and not; OpenAI error objects; the bounded FIFO queue (429 when full); cancellation of
a client that goes away; prefix reuse across the turns of a conversation."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import uvicorn

from offload_engine import Engine
from offload_engine.apps.http_guards import DEFAULT_BODY_TIMEOUT_S
from offload_engine.apps.server import create_app, uvicorn_settings
from tiny_models import make_tiny_checkpoint

KEY = "sk-test-key"
MODEL = "tiny-chat"


class LiveServer:
    """uvicorn serving `app` on a free port of 127.0.0.1, in a background thread, with the settings
    `serve` gives it (a deadline on each request's headers: `body_timeout_s`)."""

    def __init__(self, app, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {**uvicorn_settings(body_timeout_s), "timeout_graceful_shutdown": None}  # stop() finds a hang
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **settings))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the server did not shut down (a request still hangs)"


class SlowLayers:
    """The resident layer list, with a pause before each layer: a stand-in for a streamed 70B
    pass (seconds long), so that cancellation can be seen to stop a pass midway."""

    def __init__(self, layers, pause_s):
        self.layers, self.pause_s = layers, pause_s

    def __iter__(self):
        for w in self.layers:
            time.sleep(self.pause_s)
            yield w

    def __getattr__(self, name):  # snapshot(), close(): the real layers'
        return getattr(self.layers, name)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("srv") / "m", "smollm-tied", init_std=0.2)
    engine = Engine.load(folder, progress=False)
    app = create_app(engine, MODEL, api_key=KEY, max_queue=8)
    server = LiveServer(app)
    yield server, engine, app
    server.stop()
    engine.close()


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live[0].url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def health(live) -> dict:
    with urllib.request.urlopen(live[0].url + "/health", timeout=10) as r:
        return json.loads(r.read())


def raw(live, path, body=None, key=KEY, method=None, timeout=60, content_type="application/json"):
    """(status, parsed JSON body) of one HTTP request, errors included."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(live[0].url + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": content_type,
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def hold_generations(monkeypatch, engine, prompts=None):
    """Each generation waits for the returned gate before it runs (the engine looks busy);
    prompts, when given, records each generation's prompt ids in the order they started."""
    gate, real = threading.Event(), engine.generate

    def held(*args, **kw):
        if prompts is not None:
            prompts.append(kw["input_ids"])
        gate.wait(timeout=60)
        return real(*args, **kw)

    monkeypatch.setattr(engine, "generate", held)
    return gate


def chat_messages(i=0):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question number {i}: hello?"}]


def stream_text(client, **kw) -> tuple[str, str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish[-1], chunks


def test_models_and_health(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = health(live)
    assert h["status"] == "ok" and h["model"] == MODEL and h["max_queue"] == 8


def test_chat_streamed_equals_non_streamed_and_the_engine(live, client):
    engine = live[1]
    messages = chat_messages()
    reference = engine.generate(messages=messages, max_new_tokens=20)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference.text
    assert r.choices[0].finish_reason == reference.finish_reason
    assert r.usage.prompt_tokens == len(engine.prompt_ids(messages=messages))
    assert r.usage.completion_tokens == len(reference.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    text, finish, chunks = stream_text(client, model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                       stream_options={"include_usage": True})
    assert text == reference.text and finish == reference.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)


def test_completions_streamed_equals_non_streamed(live, client):
    engine = live[1]
    reference = engine.generate("The capital of France is", max_new_tokens=12)
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=12)
    assert r.object == "text_completion" and r.choices[0].text == reference.text
    assert r.usage.completion_tokens == len(reference.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                            max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason
    ids = engine.tokenizer.encode("The capital of France is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12)
    assert by_ids.choices[0].text == reference.text
    assert client.completions.create(model=MODEL, prompt="Hello", temperature=0).usage.completion_tokens <= 16


def test_stop_strings_seed_and_sampling_settings(live, client):
    full = client.chat.completions.create(model=MODEL, messages=chat_messages(1), temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    cut = text[len(text) // 2:][:3]
    stopped = client.chat.completions.create(model=MODEL, messages=chat_messages(1), temperature=0, max_tokens=24,
                                             stop=[cut])
    assert stopped.choices[0].message.content == text[:text.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    kw = dict(model=MODEL, messages=chat_messages(2), temperature=0.9, top_p=0.95, max_tokens=16)
    a = client.chat.completions.create(seed=123, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=123, **kw).choices[0].message.content
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in range(4)}
    assert a == b and len(others) > 1  # a seed reproduces a sampled answer; other seeds differ


BAD_REQUESTS = [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     "temperature"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5},
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 3},
     "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
     "stream"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": "x"}, "seed"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi " * 600}, "prompt"),
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_400_and_an_error_object(live, path, body, param):
    status, got = raw(live, path, body)
    assert status == 400, got
    err = got["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, err
    if isinstance(body, dict) and "hi " * 600 in json.dumps(body):
        assert err["code"] == "context_length_exceeded" and "context" in err["message"]
    # the server stays up and answers the next request
    ok, answer = raw(live, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_api_key_is_required_and_checked(live, client):
    status, got = raw(live, "/v1/models", key=None)
    assert status == 401 and got["error"]["code"] == "invalid_api_key"
    status, got = raw(live, "/v1/chat/completions", {"model": MODEL, "messages": chat_messages()}, key="wrong")
    assert status == 401 and got["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=live[0].url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model=MODEL, messages=chat_messages())
    assert e.value.status_code == 401
    assert health(live)["status"] == "ok"  # monitoring needs no key
    status, got = raw(live, "/v1/nothing-here")
    assert status == 404 and got["error"]["message"]


def test_eight_concurrent_clients_all_get_complete_correct_answers(live, client):
    engine = live[1]
    references = {}
    for i in range(8):
        engine.forget_prefix()
        references[i] = engine.generate(messages=chat_messages(i), max_new_tokens=24)
    before = health(live)["completed"]

    def ask(i):
        c = openai.OpenAI(base_url=live[0].url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        if i % 2:
            return stream_text(c, model=MODEL, messages=chat_messages(i), temperature=0, max_tokens=24)[:2]
        r = c.chat.completions.create(model=MODEL, messages=chat_messages(i), temperature=0, max_tokens=24)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for i, (text, finish) in enumerate(answers):
        assert (text, finish) == (references[i].text, references[i].finish_reason), i
    h = health(live)
    assert h["completed"] == before + 8 and not h["busy"] and h["waiting"] == 0


def test_a_full_queue_answers_429_and_the_queue_is_fifo(live, client, monkeypatch):
    engine, scheduler = live[1], live[2].state.scheduler
    real, order = engine.generate, []
    gate = hold_generations(monkeypatch, engine, order)
    monkeypatch.setattr(scheduler, "max_queue", 2)
    rejected_before = health(live)["rejected"]
    prompts = [f"First {i}" for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        futures = []
        for i, p in enumerate(prompts):  # one runs (held at the gate), two wait
            futures.append(pool.submit(client.completions.create, model=MODEL, prompt=p, temperature=0, max_tokens=4))
            assert wait_for(lambda: health(live)["waiting"] == i and health(live)["busy"])
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=4)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert health(live)["rejected"] == rejected_before + 1
        gate.set()
        texts = [f.result(timeout=60).choices[0].text for f in futures]
    assert order == [engine.tokenizer.encode(p) for p in prompts]  # first in, first out
    monkeypatch.setattr(engine, "generate", real)
    assert texts == [real(p, max_new_tokens=4).text for p in prompts]


def test_a_client_that_disconnects_cancels_its_generation(live, client, monkeypatch):
    engine = live[1]
    monkeypatch.setattr(engine.model, "layers", SlowLayers(engine.model.layers, 0.02))
    start = health(live)
    # streaming: read a few chunks of a long answer, then hang up
    stream = client.chat.completions.create(model=MODEL, messages=chat_messages(5), temperature=0, max_tokens=400,
                                            stream=True)
    got = 0
    for chunk in stream:
        got += 1
        if got == 4:
            break
    hung_up = time.monotonic()
    stream.close()
    assert wait_for(lambda: health(live)["cancelled"] == start["cancelled"] + 1 and not health(live)["busy"], 5)
    freed_s = time.monotonic() - hung_up
    # a whole answer would take 400 tokens x 2 layers x 20 ms = 16 s; the engine was free within a pass or so
    assert freed_s < 2.0, freed_s
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length") and time.monotonic() - t0 < 3.0
    # not streaming: the client gives up (a timeout) and closes the connection
    with pytest.raises(TimeoutError):
        raw(live, "/v1/chat/completions", {"model": MODEL, "messages": chat_messages(6), "max_tokens": 400,
                                           "temperature": 0}, timeout=0.5)
    assert wait_for(lambda: health(live)["cancelled"] == start["cancelled"] + 2 and not health(live)["busy"], 5)
    assert health(live)["completed"] == start["completed"] + 1


def test_a_waiting_request_whose_client_leaves_is_dropped_from_the_queue(live, client, monkeypatch):
    engine = live[1]
    gate = hold_generations(monkeypatch, engine)
    start = health(live)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.completions.create, model=MODEL, prompt="held", temperature=0, max_tokens=2)
        assert wait_for(lambda: health(live)["busy"])
        with pytest.raises(TimeoutError):
            raw(live, "/v1/completions", {"model": MODEL, "prompt": "leaves", "max_tokens": 2}, timeout=0.5)
        assert wait_for(lambda: health(live)["waiting"] == 0 and health(live)["cancelled"] == start["cancelled"] + 1)
        gate.set()
        assert running.result(timeout=60).choices[0].text is not None
    assert health(live)["completed"] == start["completed"] + 1


def test_second_turn_reuses_the_first_turns_cache_over_http(live, client):
    engine = live[1]
    engine.forget_prefix()
    history = chat_messages(7)
    first = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=16)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    engine.forget_prefix()
    fresh = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=16)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == second.choices[0].message.content


def test_an_idle_server_still_holds_the_queue_bound_against_a_burst():
    """The bound counts the request the worker is about to take: with --max-queue 0, a burst on
    an idle server gets one request in (the worker may not have woken yet) and 429 for the rest."""
    import asyncio

    from offload_engine.apps.server import GenRequest, Job, Scheduler

    class HeldEngine:  # stands in for the engine: holds each generation until released
        def __init__(self):
            self.gate = threading.Event()

        def generate(self, **kw):
            self.gate.wait(timeout=30)
            raise RuntimeError("released")

    engine = HeldEngine()
    scheduler = Scheduler(engine, max_queue=0)
    loop = asyncio.new_event_loop()
    try:
        req = GenRequest([1], 1, 0.0, 1.0, 0, None, [], False, False)
        accepted = [scheduler.submit(Job(req, loop)) for _ in range(5)]
        assert accepted == [True, False, False, False, False]
        assert scheduler.status()["rejected"] == 4
    finally:
        engine.gate.set()
        scheduler.close()
        loop.close()


def test_a_queued_stream_gets_keep_alive_comments(live, monkeypatch):
    """While a streamed request waits (in the queue, or on a long pass), SSE comments keep the
    connection alive; OpenAI clients skip them, and the stream still ends with [DONE]."""
    import offload_engine.apps.server as server
    engine = live[1]
    real = engine.generate
    gate = hold_generations(monkeypatch, engine)
    monkeypatch.setattr(server, "KEEPALIVE_S", 0.05)
    req = urllib.request.Request(live[0].url + "/v1/completions", method="POST", data=json.dumps(
        {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = []
        for raw_line in r:
            line = raw_line.decode().strip()
            lines.append(line)
            if line == ": keep-alive" and lines.count(": keep-alive") == 3:
                gate.set()
            if line == "data: [DONE]":
                break
    assert lines.count(": keep-alive") >= 3
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert lines.index(": keep-alive") < first_data and lines[-1] == "data: [DONE]"
    client = openai.OpenAI(base_url=live[0].url + "/v1", api_key=KEY, max_retries=0)
    gate.clear()
    threading.Timer(0.3, gate.set).start()
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == real("Hello", max_new_tokens=3).text


def test_cors_is_off_by_default_and_on_for_the_origins_given(live):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}

    def options(url):
        req = urllib.request.Request(url + "/v1/chat/completions", method="OPTIONS", headers=preflight)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("access-control-allow-origin")

    assert options(live[0].url)[1] is None  # not by default
    app = create_app(live[1], "org/tiny-chat", cors_origins=["http://localhost:3000"])
    other = LiveServer(app)
    try:
        assert options(other.url) == (200, "http://localhost:3000")
        with urllib.request.urlopen(other.url + "/v1/models/org/tiny-chat", timeout=10) as r:
            assert json.loads(r.read())["id"] == "org/tiny-chat"  # an id with a slash
    finally:
        other.stop()


def test_suffix_drafts_keep_one_store_per_api_key_and_per_conversation(tmp_path):
    """With --draft suffix, a step's latency would tell a client whether earlier text matched, so
    each API key drafts only from its own earlier requests: the same prompt sent by key A, then by
    key B, then by A again: B finds nothing in its store and A's second request drafts from A's
    first. Without keys, each conversation (its opening messages) has its own store; with
    --suffix-shared everything is pooled. Greedy answers are the same throughout."""
    folder = make_tiny_checkpoint(tmp_path / "m", "smollm-tied", init_std=0.2)
    # adapt=False: every proposal runs (no `SuffixGate` weighing a tiny model's noisy timings), so
    # what each request drafted from shows in its accepted tokens
    engine = Engine.load(folder, draft="suffix", adapt=False, progress=False)
    engine.eos_token_ids = frozenset()

    def ask(server, key, messages):
        status, got = raw((server,), "/v1/chat/completions",
                          {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 30}, key=key)
        assert status == 200, got
        return got["choices"][0]["message"]["content"], got["sequoia"]["suffix"]

    try:
        server = LiveServer(create_app(engine, MODEL, api_key=["key-a", "key-b"]))
        try:
            a1, sa1 = ask(server, "key-a", chat_messages(1))
            b, sb = ask(server, "key-b", chat_messages(1))
            a2, sa2 = ask(server, "key-a", chat_messages(1))
        finally:
            server.stop()
        assert a1 == b == a2
        assert sb["store_matched_steps"] == 0 and sa2["store_matched_steps"] >= 1 and sa2["accepted_tokens"] >= 10
        for shared in (False, True):
            engine.suffix_store.clear()
            server = LiveServer(create_app(engine, MODEL, suffix_shared=shared))
            try:
                ask(server, None, chat_messages(2))
                _, other = ask(server, None, chat_messages(3)[:1] + [{"role": "user", "content": "Another one."},
                                                                      {"role": "assistant", "content": "Yes."},
                                                                      chat_messages(2)[1]])
                _, same = ask(server, None, chat_messages(2))
            finally:
                server.stop()
            assert same["store_matched_steps"] >= 1
            assert (other["store_matched_steps"] >= 1) == shared, (shared, other)
    finally:
        engine.close()


def test_the_chat_page_files_are_served_as_shipped_with_a_strict_policy(live):
    """/, /chat.js and /chat.css are the package's files byte for byte (a query string changes
    nothing), without a key, each with its type and the page's security headers."""
    from offload_engine.apps.server import WEB_DIR
    for path, name, kind in (("/", "index.html", "text/html"), ("/chat.js?body=x", "chat.js", "text/javascript"),
                             ("/chat.css", "chat.css", "text/css")):
        with urllib.request.urlopen(live[0].url + path, timeout=30) as r:
            assert r.read() == (WEB_DIR / name).read_bytes()
            assert r.headers["Content-Type"].startswith(kind)
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            assert "default-src 'none'" in r.headers["Content-Security-Policy"]
            assert r.headers["X-Content-Type-Options"] == "nosniff"


def test_a_draft_switch_waits_until_the_client_has_its_answer():
    """--draft auto may load another draft after an answer (`Engine.after_answer`), which takes as
    long as loading a draft. The worker hands the answer to its client first and switches after,
    so the client does not wait for it (the next request does); the engine's generate is asked
    not to switch itself."""
    import asyncio

    from offload_engine.apps.server import GenRequest, Job, Scheduler

    class SwitchingEngine:
        def __init__(self):
            self.calls, self.release, self.job = [], threading.Event(), None

        def generate(self, **kw):
            self.calls.append(("generate", kw.get("switch")))
            return "the answer"

        def after_answer(self):
            self.calls.append(("after_answer", None))
            self.release.wait(timeout=10)

    engine = SwitchingEngine()
    scheduler = Scheduler(engine, max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        engine.job = job = Job(GenRequest([1], 1, 0.0, 1.0, 0, None, [], False, False), loop)
        assert scheduler.submit(job)
        # the "done" event is queued while the switch still holds the worker
        kind, value = loop.run_until_complete(asyncio.wait_for(job.events.get(), timeout=5))
        assert (kind, value) == ("done", "the answer")
        for _ in range(300):
            if len(engine.calls) == 2:
                break
            time.sleep(0.01)
        assert engine.calls[0] == ("generate", False) and engine.calls[1][0] == "after_answer"
        assert scheduler.status()["completed"] == 1
    finally:
        engine.release.set()
        scheduler.close()
        loop.close()
