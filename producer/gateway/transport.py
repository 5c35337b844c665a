"""uvicorn's httptools protocol, sending a response's head and body in one write.

Why: uvicorn writes the status line and headers, then the body, as two transport writes. For
the gateway's small JSON answers that is two send() calls and, on loopback, two wake-ups of
the client for one answer, which on a busy machine cost more than the HTTP parsing. The head
is held instead and goes out with the next write, or at the end of the event-loop iteration
at the latest (call_soon), so nothing waits longer than the code that sends the body.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


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
