"""HTTP/1.1 on a bare socket, for the requests a client library would never send: bodies larger
than declared or sent chunked without end, headers or bodies a byte at a time, responses read
while the body is still going out (tests/test_hostile_server.py)."""

import socket
import threading
from pathlib import Path

MiB = 1024 * 1024


def request_head(path: str, key: str, **headers) -> bytes:
    """A POST's request line and headers (underscores in `headers` names written as dashes)."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {key}",
             "Content-Type: application/json", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response with a Content-Length."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, f"the connection closed before a response: {data!r}"
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return int(status_line.split()[1]), headers, body


def closed_within(sock: socket.socket, timeout: float) -> bool:
    """True when the peer closes (or resets) the connection within `timeout` seconds."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def socket_buffers_max() -> int:
    """The most a sender's and a receiver's TCP buffers can hold (Linux's autotuning limits): what a
    client can get out beyond what the server read."""
    try:
        return sum(int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2]) for name in ("tcp_wmem", "tcp_rmem"))
    except OSError:
        return 16 * MiB


def send_until_refused(sock: socket.socket, pieces) -> int:
    """Send each piece until the server stops taking them; the bytes sent."""
    sock.settimeout(5)
    sent = 0
    try:
        for piece in pieces:
            sock.sendall(piece)
            sent += len(piece)
    except OSError:  # reset, broken pipe, or the buffers full and nobody reading (a timeout)
        pass
    return sent


def trickle(sock: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> threading.Thread:
    """Send `data` one byte every `every_s` seconds in a thread, until refused or stopped."""
    def run():
        for i in range(len(data)):
            if stop.wait(every_s):
                return
            try:
                sock.send(data[i:i + 1])
            except OSError:
                return
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def chunked(pieces, end: bool = True):
    """HTTP/1.1 chunked transfer coding of `pieces` (with the last, empty chunk when `end`)."""
    for piece in pieces:
        yield b"%x\r\n%s\r\n" % (len(piece), piece)
    if end:
        yield b"0\r\n\r\n"


def post_raw(port: int, head: bytes, pieces) -> tuple[tuple[int, dict, bytes], int]:
    """Send `head` then `pieces` while reading the response in a thread: (response, bytes sent)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        answer = {}

        def read():
            try:
                answer["response"] = read_response(sock, 60)
            except (OSError, AssertionError) as e:
                answer["response"] = e
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        sent = send_until_refused(sock, pieces)
        reader.join(60)
    assert isinstance(answer["response"], tuple), answer
    return answer["response"], sent
