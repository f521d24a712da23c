"""Bounds on what one client can make the server read or wait for, below the API's routes.

`BodyLimits` (ASGI middleware): a request body larger than `max_body_bytes` is answered 413 (from
its Content-Length before a byte of it is read, else counted while it is read, stopping at the
limit), and one that does not arrive whole within `body_timeout_s` of its headers is answered 408;
any answer sent before the body was read whole closes the connection, so the rest is never read.
`header_deadline_protocol`: uvicorn's h11 protocol waits for a request's headers forever (a client
sending them a byte at a time holds its connection open: "slowloris"); this one closes a connection
whose headers have not arrived within the timeout of its opening, or of its previous answer.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .openai_requests import ApiError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: a prompt of a million characters and more
DEFAULT_BODY_TIMEOUT_S = 30.0  # for a request's headers, then as long for its body (4 MiB needs 1.2 Mbit/s)


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    return int(value) if value is not None and value.strip().isdigit() else None  # (h11 refuses a bad one)


class BodyLimits:
    """Raises ApiError 413/408 from `receive` inside the app, whose handler answers it in OpenAI's
    form; a response that starts before the body was read whole gets `Connection: close`."""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s

    def too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
                        "(--max-body)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = _content_length(headers)
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        state = {"complete": not chunked and not declared, "read": 0}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s

        async def bounded_receive():
            if state["complete"]:  # the body is in: what follows is the disconnect, whenever it comes
                return await receive()
            if declared is not None and declared > self.max_body_bytes:
                raise self.too_large()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} seconds "
                               "(--body-timeout)", code="request_timeout") from None
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > self.max_body_bytes:
                    raise self.too_large()
                state["complete"] = not message.get("more_body", False)
            return message

        async def closing_send(message):
            if message["type"] == "http.response.start" and not state["complete"]:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, bounded_receive, closing_send)


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's headers (`uvicorn.Config(http=...)`)."""

    class HeaderDeadline(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
