"""CoalescingTransport (producer/gateway/transport.py): a response head goes out with the
body in one write, and never waits past the event loop's next turn."""

from __future__ import annotations

import asyncio
from typing import Any

from producer.gateway.transport import CoalescingTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> Any:
        return f"info:{name}"


def test_head_and_body_go_in_one_write() -> None:
    async def run() -> list[bytes]:
        fake = FakeTransport()
        transport = CoalescingTransport(fake)  # type: ignore[arg-type]
        transport.write(HEAD)
        assert fake.writes == []
        transport.write(b"{}")
        await asyncio.sleep(0)
        transport.write(b"not a head")
        return fake.writes
    assert asyncio.run(run()) == [HEAD + b"{}", b"not a head"]


def test_a_lone_head_is_sent_on_the_next_turn_and_before_close() -> None:
    async def run() -> tuple[list[bytes], list[bytes], bool]:
        fake = FakeTransport()
        transport = CoalescingTransport(fake)  # type: ignore[arg-type]
        transport.write(HEAD)
        await asyncio.sleep(0)
        after_turn = list(fake.writes)
        transport.write(HEAD)
        transport.close()
        return after_turn, fake.writes, fake.closed
    after_turn, writes, closed = asyncio.run(run())
    assert after_turn == [HEAD] and writes == [HEAD, HEAD] and closed


def test_everything_else_is_the_real_transport() -> None:
    transport = CoalescingTransport(FakeTransport())  # type: ignore[arg-type]
    assert transport.get_extra_info("peername") == "info:peername"
    assert not transport.is_closing()
