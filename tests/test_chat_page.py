"""The chat page `serve` shows at /, in a real browser: the distribution's headless Chromium driven
by Selenium through the distribution's chromedriver, against a live server on a tiny model.
A streamed answer appears piece by piece with its stats line; stop cancels the generation on the
server (its count of cancelled requests); the conversation survives a reload; an answer that
holds HTML is shown as text; a wrong key and a full queue are explained in words; a phone-width
window has no sideways scrolling. A screenshot of a two-turn conversation is saved to
test-artifacts/chat_page.png.

`.ci/run` installs Chromium and chromedriver when they are missing; `make test` skips this file,
saying why, only where either is missing."""

import json
import shutil
import threading
from pathlib import Path

import pytest

from offload_engine import Engine
from offload_engine.apps.server import create_app
from offload_engine.engine import GenerationResult
from test_server import LiveServer, SlowLayers, health, wait_for
from tiny_models import make_tiny_checkpoint

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="no Chromium or chromedriver on this machine: install the distribution's chromium and chromium-driver "
           "packages (.ci/run does) to run the chat page's browser tests")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
MODEL = "tiny-chat"
KEY = "sk-page-key"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("page") / "m", "smollm-tied", init_std=0.2)
    e = Engine.load(folder, progress=False)
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(create_app(engine, MODEL, max_queue=4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,900", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def until(predicate, timeout=30.0, what="the page"):
    assert wait_for(predicate, timeout), f"timed out waiting for {what}"


def page_state(browser) -> str:
    """What the page shows, for a failure's message."""
    try:
        return browser.execute_script(
            "return JSON.stringify({error: document.getElementById('error').textContent, "
            "send: !document.getElementById('send').hidden, messages: document.getElementById('messages').innerText})")
    except Exception as e:  # noqa: BLE001 - a failure message must not fail itself
        return f"(page state unavailable: {e})"


def open_page(browser, url, fresh=True):
    browser.get(url + "/")
    if fresh:
        browser.execute_script("localStorage.clear()")
        browser.get(url + "/")
    until(lambda: browser.execute_script("return document.readyState") == "complete")


def set_field(browser, element_id, value):
    browser.execute_script("document.getElementById('settings').open = true")
    el = browser.find_element("id", element_id)
    el.clear()
    el.send_keys(str(value))


def send(browser, text):
    from selenium.webdriver.common.keys import Keys
    box = browser.find_element("id", "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def answers(browser):
    return browser.find_elements("css selector", "#messages .msg.assistant")


def last_answer(browser, part: str) -> str:
    """The shown text of the last answer's part (".text" or ".stats"), read in one call in the page:
    the page re-renders its messages when an answer ends, so an element held here could go stale."""
    return browser.execute_script(
        "const a = [...document.querySelectorAll('#messages .msg.assistant')].pop();"
        "const el = a && a.querySelector(arguments[0]); return el ? el.innerText : '';", part)


def stored(browser) -> dict:
    data = json.loads(browser.execute_script("return localStorage.getItem('sequoia-offload.chats')"))
    return data["chats"][data["active"]]


def idle(browser):
    return browser.find_element("id", "send").is_displayed()


def test_a_streamed_answer_appears_piece_by_piece_with_its_stats(browser, server, engine, monkeypatch):
    monkeypatch.setattr(engine.model, "layers", SlowLayers(engine.model.layers, 0.01))
    open_page(browser, server.url)
    until(lambda: browser.find_element("id", "model-name").text == MODEL, what="the model's name")
    set_field(browser, "temperature", 0)
    set_field(browser, "max-tokens", 24)
    set_field(browser, "system", "Be brief.")
    # every text the answer shows on its way, recorded in the page (polling from here could miss
    # them on a loaded machine)
    browser.execute_script("""
        window.seenTexts = [];
        new MutationObserver(() => {
          const last = [...document.querySelectorAll('#messages .msg.assistant .text')].pop();
          const text = last ? last.textContent : '';
          if (text && window.seenTexts[window.seenTexts.length - 1] !== text) window.seenTexts.push(text);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    """)
    send(browser, "Hello there, how are you?")
    assert wait_for(lambda: idle(browser) and answers(browser), 60), page_state(browser)
    partial = browser.execute_script("return window.seenTexts")
    assert len(partial) >= 2, f"the answer did not stream in pieces: {partial}"
    stats = last_answer(browser, ".stats")
    assert "tokens/s" in stats and "tokens/step" in stats and "prompt tokens reused" in stats, stats
    expected = engine.generate(messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hello there, how are you?"}],
                               max_new_tokens=24, temperature=0.0)
    chat = stored(browser)
    assert chat["messages"][-1]["content"] == expected.text  # what the page kept is the engine's greedy answer
    assert chat["title"] == "Hello there, how are you?"


def test_stop_cancels_the_generation_on_the_server(browser, server, engine, monkeypatch):
    monkeypatch.setattr(engine.model, "layers", SlowLayers(engine.model.layers, 0.05))
    open_page(browser, server.url)
    set_field(browser, "max-tokens", 400)
    before = health((server,))
    send(browser, "Tell me a long story.")
    until(lambda: last_answer(browser, ".text"),
          what="the first words")
    browser.find_element("id", "stop").click()
    until(lambda: health((server,))["cancelled"] == before["cancelled"] + 1 and not health((server,))["busy"],
          timeout=10, what="the server to cancel")
    until(lambda: idle(browser), what="the send button")
    assert "stopped" in last_answer(browser, ".stats")
    assert health((server,))["completed"] == before["completed"]


def test_the_conversation_survives_a_reload(browser, server):
    open_page(browser, server.url)
    set_field(browser, "max-tokens", 6)
    send(browser, "First question")
    until(lambda: idle(browser) and len(answers(browser)) == 1, what="the first answer")
    send(browser, "Second question")
    until(lambda: idle(browser) and len(answers(browser)) == 2, what="the second answer")
    before = [m.get_attribute("textContent") for m in browser.find_elements("css selector", "#messages .msg")]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "chat_page.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    open_page(browser, server.url, fresh=False)
    after = [m.get_attribute("textContent") for m in browser.find_elements("css selector", "#messages .msg")]
    assert after == before and len(after) == 4
    assert len(browser.find_elements("css selector", "#conversations li")) == 1
    assert browser.find_element("id", "max-tokens").get_attribute("value") == "6"  # settings kept too


def scripted(engine, monkeypatch, answer: str):
    """The engine's next answers are `answer`, streamed in small pieces (the server's code path)."""
    real = engine.generate

    def generate(*args, **kw):
        on_token = kw.pop("on_token", None)
        result = real(*args, **{**kw, "max_new_tokens": 1})
        for i in range(0, len(answer), 5):
            if on_token is not None:
                on_token(0, answer[i:i + 5])
        return GenerationResult(answer, [0] * len(answer), "stop", result.stats)

    monkeypatch.setattr(engine, "generate", generate)


def test_an_answer_holding_html_is_shown_as_text(browser, server, engine, monkeypatch):
    answer = ('Try <script>window.pwned = 1</script> or <img src=x onerror="window.pwned = 2"> and `<b>x</b>`.'
              '\n\n```html\n<iframe src="/"></iframe>\n```\nDone.')
    scripted(engine, monkeypatch, answer)
    open_page(browser, server.url)
    send(browser, "<img src=y onerror=\"window.pwned = 3\"> show me html")
    assert wait_for(lambda: idle(browser) and answers(browser), 30), page_state(browser)
    msgs = browser.find_element("id", "messages")
    assert msgs.find_elements("css selector", "script, img, iframe, b") == []
    text = answers(browser)[-1].find_element("css selector", ".text")
    assert "<script>window.pwned = 1</script>" in text.text
    assert text.find_element("css selector", "pre code").text == '<iframe src="/"></iframe>'
    assert text.find_element("css selector", "p code").text == "<b>x</b>"
    assert browser.execute_script("return window.pwned") is None
    assert '<img src=y onerror="window.pwned = 3">' in msgs.find_element("css selector", ".msg.user").text
    assert stored(browser)["messages"][-1]["content"] == answer


def test_a_wrong_key_and_a_full_queue_are_explained(browser, engine, monkeypatch):
    server = LiveServer(create_app(engine, MODEL, api_key=KEY, max_queue=0))
    try:
        open_page(browser, server.url)
        send(browser, "hi")
        until(lambda: browser.find_element("id", "error").is_displayed(), what="the error")
        assert "needs an API key" in browser.find_element("id", "error").text
        assert "missing API key" in browser.find_element("id", "error").text  # the server's own words
        assert browser.find_element("id", "input").get_attribute("value") == "hi"  # given back to send again
        assert answers(browser) == []
        set_field(browser, "api-key", "sk-wrong")
        browser.find_element("id", "send").click()
        until(lambda: "API key given is wrong" in browser.find_element("id", "error").text, what="the wrong-key error")
        assert "incorrect API key" in browser.find_element("id", "error").text
        set_field(browser, "api-key", KEY)
        set_field(browser, "max-tokens", 4)
        gate = threading.Event()
        real = engine.generate
        monkeypatch.setattr(engine, "generate", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
        import urllib.request
        busy = threading.Thread(target=lambda: urllib.request.urlopen(urllib.request.Request(
            server.url + "/v1/chat/completions", method="POST", data=json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}), timeout=60).read())
        busy.start()
        until(lambda: health((server,))["busy"], timeout=10, what="the server to be busy")
        browser.find_element("id", "send").click()
        until(lambda: "busy" in browser.find_element("id", "error").text, what="the busy error")
        gate.set()
        busy.join(60)
        until(lambda: not health((server,))["busy"], timeout=10)
        browser.find_element("id", "send").click()
        until(lambda: idle(browser) and answers(browser), what="the answer with the right key")
        assert not browser.find_element("id", "error").is_displayed()
    finally:
        server.stop()


def test_a_phone_width_window_has_no_sideways_scrolling(browser, server):
    open_page(browser, server.url)
    set_field(browser, "max-tokens", 4)
    send(browser, "a question that is long enough to wrap on a narrow screen " * 3)
    until(lambda: idle(browser) and answers(browser), what="the answer")
    browser.set_window_size(390, 844)
    try:
        width = browser.execute_script("return document.documentElement.clientWidth")
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width
        assert browser.find_element("id", "toggle-side").is_displayed()
        assert not browser.find_element("id", "side").is_displayed()
        assert browser.find_element("id", "input").is_displayed()
        browser.find_element("id", "toggle-side").click()
        assert browser.find_element("id", "new-chat").is_displayed()
    finally:
        browser.set_window_size(1200, 900)


def test_unreadable_stored_conversations_are_set_aside_not_fatal(browser, server):
    """Local storage written by something else (another page on this origin, an older version):
    the page still works, says so, and keeps the unreadable text aside."""
    open_page(browser, server.url)
    browser.execute_script("localStorage.setItem('sequoia-offload.chats', JSON.stringify({order: [], chats: "
                           "{x: {title: 1, messages: null}}}))")
    open_page(browser, server.url, fresh=False)
    until(lambda: browser.find_element("id", "error").is_displayed(), what="the notice")
    assert "could not be read" in browser.find_element("id", "error").text
    assert browser.execute_script("return localStorage.getItem('sequoia-offload.chats.unreadable')")
    set_field(browser, "max-tokens", 3)
    send(browser, "still works?")
    until(lambda: idle(browser) and answers(browser), what="an answer")
    assert stored(browser)["messages"][0]["content"] == "still works?"
