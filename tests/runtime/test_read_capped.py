"""A signed document is read whole before its signature is checked, so the size of what a
party answers is capped while it is read (common.fetching.fetch_within)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from common.fetching import FetchTooLargeError, deadline_client, fetch_within

from ..support import QuietHandler, handler_served

CHUNK = 64 * 1024


class _Streaming(QuietHandler):
    """Answers ``GET /<n>`` with n bytes, chunked, in pieces of :data:`CHUNK`; counts what it
    managed to send before the reader hung up."""

    sent: ClassVar[list[int]] = []

    def do_GET(self) -> None:
        total, sent = int(self.path.strip("/")), 0
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while sent < total:
                piece = min(CHUNK, total - sent)
                self.wfile.write(f"{piece:x}\r\n".encode() + b"x" * piece + b"\r\n")
                sent += piece
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            type(self).sent.append(sent)


@pytest.fixture
def server() -> Iterator[str]:
    with handler_served(_Streaming) as url:
        yield url


def _read(url: str, limit: int) -> bytes | None:
    with deadline_client(30.0) as http:
        try:
            return fetch_within(http, url, limit, 30.0).body
        except FetchTooLargeError:
            return None


def test_a_body_up_to_the_cap_is_read_whole_and_one_byte_more_is_refused(server: str) -> None:
    assert _read(f"{server}/150000", 150_000) == b"x" * 150_000
    assert _read(f"{server}/150001", 150_000) is None


def test_an_endless_answer_is_abandoned_soon_after_the_cap(server: str) -> None:
    _Streaming.sent.clear()
    assert _read(f"{server}/{1 << 34}", 100_000) is None
    for _ in range(200):  # the handler notices the closed socket on one of its next writes
        if _Streaming.sent:
            break
        threading.Event().wait(0.05)
    assert _Streaming.sent and _Streaming.sent[0] < 64 << 20
