"""A minimal keep-alive HTTP/1.1 client for the gateway benchmark (bench/gateway/compare.py).

Written by hand: it costs the load generator about what redis-py costs it on the direct
path, where an HTTP library (httpx) cost several times more per call.
"""

from __future__ import annotations

import asyncio


class HttpPool:
    """A minimal HTTP/1.1 client: keep-alive connections to one host, POST with a
    Content-Length body, replies read by their Content-Length (as uvicorn sends them). It
    costs the load generator about what redis-py costs it on the direct path, so the figures
    measure the gateway rather than the HTTP client library (`--http-client httpx` for one)."""

    def __init__(self, base_url: str) -> None:
        self.host, _, port = base_url.removeprefix("http://").partition(":")
        self.port = int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> bytes:
        """The 200 reply's body; RuntimeError for another status. An idle connection the
        server has closed meanwhile (uvicorn's keep-alive timeout) is replaced."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not reader.at_eof():
                try:
                    return await self._exchange(reader, writer, path, body)
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass
            writer.close()
        return await self._exchange(*await asyncio.open_connection(self.host, self.port),
                                    path, body)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        path: str, body: bytes) -> bytes:
        writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(),
                                                          len(body), body))
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        data = await reader.readexactly(length)
        self.idle.append((reader, writer))
        if not head.startswith(b"http/1.1 200"):
            status_line = head.partition(b"\r\n")[0]
            raise RuntimeError(f"{status_line!r}: {data[:200]!r}")
        return data

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
