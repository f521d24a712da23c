"""Make docs/chat-page.png: the chat page after a two-turn conversation with the embedded default pair.

    python scripts/chat_screenshot.py [--out docs/chat-page.png] [--port 8765] [--width 1200 --height 900]

Starts `sequoia-offload serve --draft default` as a process on 127.0.0.1, drives the page in the
distribution's headless Chromium (Selenium with its chromedriver, as tests/test_chat_page.py does),
asks two questions greedily, waits for each streamed answer and its stats line, saves the
screenshot and stops the server with Ctrl-C (SIGINT). Needs the test extra (selenium) and the
chromium and chromium-driver packages.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("What is the capital of France?", "And what is it famous for? Answer in two sentences.")


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - the page or server is not there yet
            value = None
        if value:
            return value
        time.sleep(0.2)
    sys.exit(f"chat_screenshot: timed out waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "chat-page.png"))
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--width", type=int, default=1200)
    p.add_argument("--height", type=int, default=900)
    p.add_argument("--max-tokens", type=int, default=80)
    args = p.parse_args()
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        sys.exit("chat_screenshot: needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.keys import Keys

    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "offload_engine", "serve", "--draft", "default",
                               "--port", str(args.port)], cwd=ROOT)
    driver = None
    try:
        wait(lambda: json.load(urllib.request.urlopen(url + "/health", timeout=2))["status"] == "ok", 600,
             "the server to start")
        opts = webdriver.ChromeOptions()
        opts.binary_location = chromium
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--window-size={args.width},{args.height}", "--hide-scrollbars"):
            opts.add_argument(arg)
        driver = webdriver.Chrome(service=Service(driver_path), options=opts)
        driver.get(url + "/")
        driver.execute_script("localStorage.clear()")
        driver.get(url + "/")
        driver.execute_script("document.getElementById('settings').open = true")
        for field, value in (("temperature", "0"), ("max-tokens", str(args.max_tokens))):
            el = driver.find_element("id", field)
            el.clear()
            el.send_keys(value)
        driver.execute_script("document.getElementById('settings').open = false")
        for n, question in enumerate(QUESTIONS, 1):
            box = driver.find_element("id", "input")
            box.send_keys(question)
            box.send_keys(Keys.ENTER)
            wait(lambda: len(driver.find_elements("css selector", "#messages .msg.assistant .stats")) == n
                 and driver.find_elements("css selector", "#messages .msg.assistant .stats")[-1].text
                 and driver.find_element("id", "send").is_displayed(), 600, f"answer {n}")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp.png")
        driver.save_screenshot(str(tmp))
        tmp.replace(out)
        print(f"chat_screenshot: {out}")
        for el in driver.find_elements("css selector", "#messages .msg.assistant .stats"):
            print("  " + el.text)
    finally:
        if driver is not None:
            driver.quit()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
