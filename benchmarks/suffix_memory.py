"""The suffix drafts' store under a long server run: it must stay under its cap (`--suffix-memory`)
and the server's memory flat, whatever the clients send.

    python benchmarks/suffix_memory.py [--target default] [--requests 1000] [--cap 20000] [--json FILE]

A live `serve` (uvicorn on 127.0.0.1, `--draft suffix`, the target resident) gets `--requests`
chat requests over HTTP, one at a time, from 50 conversations that grow turn by turn (each its own
store key, since the server has no API key) with greedy answers of 8 tokens. After every request
the store's size and key count are read; the process's resident memory (VmRSS) is read after a
warm-up of 50 requests and at the end.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS = ("river mountain coffee window garden letter music winter market bridge story lamp paper "
         "orange station village ocean pencil summer forest").split()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from offload_engine import Engine
    from offload_engine.apps.server import create_app
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--cap", type=int, default=20_000, help="--suffix-memory, tokens (default 20,000)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    engine = Engine.load(args.target, draft="suffix", offload="none", suffix_memory=args.cap, progress=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "m"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    conversations: list[list[dict]] = [[{"role": "user", "content": f"Conversation {c}: tell me about the "
                                         f"{WORDS[c % len(WORDS)]}."}] for c in range(50)]
    sizes, keys, accepted, rss = [], [], 0, {}
    started = time.perf_counter()
    try:
        for i in range(args.requests):
            conv = conversations[i % len(conversations)]
            body = json.dumps({"model": "m", "messages": conv, "temperature": 0, "max_tokens": 8}).encode()
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.loads(r.read())
            accepted += got["sequoia"]["suffix"]["accepted_tokens"]
            conv.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
            conv.append({"role": "user", "content": f"And the {WORDS[(i * 7) % len(WORDS)]}?"})
            if len(conv) > 12:  # the client keeps its last turns (the opening stays: the same store)
                del conv[1:3]
            sizes.append(engine.suffix_store.tokens)
            keys.append(engine.suffix_store.keys())
            if i + 1 == 50:
                rss["after_warmup_mib"] = rss_mib()
            if (i + 1) % 100 == 0:
                print(f"{i + 1} requests: store {sizes[-1]} tokens in {keys[-1]} keys, RSS {rss_mib():.0f} MiB, "
                      f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        rss["end_mib"] = rss_mib()
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        engine.close()
    res = {"requests": args.requests, "cap_tokens": args.cap, "max_store_tokens": max(sizes),
           "final_store_tokens": sizes[-1], "max_keys": max(keys), "accepted_suffix_tokens": accepted,
           "rss": rss, "seconds": time.perf_counter() - started,
           "under_cap_after_every_request": all(s <= args.cap for s in sizes)}
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["under_cap_after_every_request"] else 1


if __name__ == "__main__":
    sys.exit(main())
