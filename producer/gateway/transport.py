"""uvicorn's httptools protocol, sending a response's head and body in one write, and
enforcing the per-connection limits uvicorn lacks (header size, header and body deadlines).

Why: uvicorn writes the status line and headers, then the body, as two transport writes. For
the gateway's small JSON answers that is two send() calls and, on loopback, two wake-ups of
the client for one answer, which on a busy machine cost more than the HTTP parsing. The head
is held instead and goes out with the next write, or at the end of the event-loop iteration
at the latest (call_soon), so nothing waits longer than the code that sends the body.

Limits: uvicorn's httptools protocol buffers a header block of any size and waits forever for
an unfinished one or a drip-fed body (issue 30). GuardedHttpToolsProtocol counts the bytes of
each header block (431 and close past `max_header_bytes`, so a connection holds at most that
plus one read), gives the header block `header_timeout_s` from the connection's start or the
request's first byte and the body `body_timeout_s` from the end of its headers (408 and close
otherwise). The limits come from the app (limits.limits_of), as uvicorn hands a protocol
nothing else of ours, in one process or many.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from producer.gateway import jsonio
from producer.gateway.limits import limits_of


class CoalescingTransport:
    """A transport whose response heads wait for the body (or the loop's next turn)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held:
            data, self._held = self._held + bytes(data), b""
        elif bytes(data[:5]) == b"HTTP/" and not self._transport.is_closing():
            self._held = bytes(data)  # uvicorn writes a response head on its own
            asyncio.get_running_loop().call_soon(self.flush)
            return
        self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        self.write(b"".join(lines))

    def flush(self) -> None:
        if self._held:
            data, self._held = self._held, b""
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol writing through a CoalescingTransport (flow control, addresses and
    upgrades keep the real transport)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescingTransport(transport)  # type: ignore[assignment]


def refusal(status: int, message: str, code: str) -> bytes:
    """A whole `Connection: close` response with OpenAI's error body, written by the
    protocol itself (no app runs for it)."""
    body = jsonio.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": code}})
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n",
                     body])


class GuardedHttpToolsProtocol(CoalescingHttpToolsProtocol):
    """CoalescingHttpToolsProtocol with a header size cap and header and body deadlines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits_of(self.app)
        self._in_head = True  # between a message's first byte (or the connection's start)
        self._head_bytes = 0  # and the end of its headers
        self._parsed_bytes = 0  # the request line's target and the headers, as parsed
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.transport.is_closing():
            return
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)  # all of it still header bytes: none completed
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._parsed_bytes = True, 0, 0
        if self._deadline is None:  # a first request keeps the deadline of its connection
            self._arm(self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed_bytes += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """A block that arrived whole in one read is measured here, before any app runs."""
        self._in_head, self._head_bytes = False, 0
        if self._parsed_bytes > self.limits.max_header_bytes:
            self._refuse_headers()
            return
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing():  # closing: refused, no cycle to feed
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            super().on_message_complete()

    def _refuse_headers(self) -> None:
        self._refuse(431, f"the request's headers are larger than "
                     f"{self.limits.max_header_bytes} bytes", "headers_too_large")

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        """A deadline passed: 408 unless a response has started already, then close."""
        self._deadline = None
        if self.transport.is_closing():
            return
        part = "headers" if self._in_head else "body"
        if self._in_head or not (self.cycle and self.cycle.response_started):
            if self.cycle is not None:
                self.cycle.keep_alive = False
            self._refuse(408, f"the request's {part} did not arrive in time", "request_timeout")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._disarm()
        self.logger.warning("refused a connection: %s", message)
        self.transport.write(refusal(status, message, code))
        self.transport.close()
