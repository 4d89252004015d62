"""A fetch of another party's document ends at its whole-request deadline however slowly the
other side answers (common.fetching.fetch_within): httpx's own timeouts bound each read only."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.envelope import public_bytes
from common.fetching import (
    FetchDeadlineError,
    FetchTooLargeError,
    deadline_client,
    fetch_within,
    post_within,
)
from common.wire import b64
from encoder_client import Client, ConfigError

from ..shuffler.factory import make_service
from ..support import QuietHandler, handler_served

BODY = b'{"hello": "world"}'


class _Dribbling(QuietHandler):
    """Answers one byte every ``gap`` seconds: in the status line and headers (``/head``) or in
    the body (``/body``); ``/fast`` answers at once."""

    gap: ClassVar[float] = 0.3

    def do_GET(self) -> None:
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
        )
        try:
            where = self.path.split("/")[1]  # /head/v1/config: as /head
            if where == "fast":
                self.wfile.write(head + BODY)
                return
            slow = head + BODY if where == "head" else BODY
            if where == "body":
                self.wfile.write(head)
            for byte in slow:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(self.gap)
        except OSError:
            pass

    def do_POST(self) -> None:
        """Reads the body (echoed in ``X-Got``) and answers as a GET of the same path."""
        got = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/fast"):
            self.send_response(202)
            self.send_header("X-Got", got.decode())
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)
            return
        self.do_GET()


def _timed(url: str, seconds: float) -> float:
    start = time.monotonic()
    with deadline_client(seconds) as client, pytest.raises(FetchDeadlineError, match="deadline"):
        fetch_within(client, url, 1 << 20, seconds)
    return time.monotonic() - start


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_server_answering_a_byte_at_a_time_is_cut_at_the_deadline(where: str) -> None:
    """Every byte arrives well within httpx's per-read timeout (``seconds``), the whole answer
    would take ~25 s (head) or ~5 s (body): the fetch ends at 1 s (+ scheduling)."""
    with handler_served(_Dribbling) as url:
        took = _timed(f"{url}/{where}", 1.0)
    assert 1.0 <= took < 3.0, took


def test_a_prompt_answer_is_read_whole_and_a_long_one_refused() -> None:
    with handler_served(_Dribbling) as url, deadline_client(2.0) as client:
        fetched = fetch_within(client, f"{url}/fast", 1 << 20, 2.0)
        assert (fetched.status, fetched.body) == (200, BODY)
        with pytest.raises(FetchTooLargeError, match=f"over {len(BODY) - 1} bytes"):
            fetch_within(client, f"{url}/fast", len(BODY) - 1, 2.0)


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_post_answered_a_byte_at_a_time_is_cut_at_the_deadline(where: str) -> None:
    """A device's contribution POST: the whole answer would take ~25 s (head) or ~5 s (body);
    the POST ends at 1 s (+ scheduling)."""
    start = time.monotonic()
    with (
        handler_served(_Dribbling) as url,
        deadline_client(1.0) as client,
        pytest.raises(FetchDeadlineError, match=r"POST .* deadline"),
    ):
        post_within(client, f"{url}/{where}", content=b"sealed", limit=1 << 20, seconds=1.0)
    assert 1.0 <= time.monotonic() - start < 4.0


def test_a_prompt_post_answer_is_read_whole_with_its_headers() -> None:
    with handler_served(_Dribbling) as url, deadline_client(2.0) as client:
        fetched = post_within(
            client,
            f"{url}/fast",
            content=b"sealed",
            headers={"Content-Type": "application/octet-stream"},
            limit=1 << 20,
            seconds=2.0,
        )
    assert (fetched.status, fetched.body, fetched.headers["x-got"]) == (202, BODY, "sealed")


def test_a_server_that_never_answers_is_cut_at_the_deadline() -> None:
    """A listener that accepts (the kernel's backlog) and never reads nor answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        start = time.monotonic()
        with deadline_client(0.5) as client, pytest.raises(httpx.TimeoutException):
            fetch_within(client, f"http://127.0.0.1:{listener.getsockname()[1]}/", 100, 0.5)
        assert time.monotonic() - start < 2.5


def test_the_sdk_config_fetch_ends_at_its_timeout(tmp_path: Path) -> None:
    """A device's ``timeout`` bounds its whole config fetch: a config server answering one
    byte at a time is a ConfigError after ~1 s, not after the whole answer (~25 s)."""
    key = b64(public_bytes(Ed25519PrivateKey.generate().public_key()))
    start = time.monotonic()
    with handler_served(_Dribbling) as url, pytest.raises(ConfigError, match="deadline"):
        Client(
            f"{url}/head",
            trusted_key=key,
            shuffler_keys={"shuffler-1": key},
            every_shuffler=False,
            state_path=tmp_path / "state.sqlite",
            background=False,
            timeout=1.0,
        )
    assert time.monotonic() - start < 3.0


def test_a_shuffler_following_a_slow_analyzer_gives_up_at_its_deadline(tmp_path: Path) -> None:
    """The analyzer's config answered a byte at a time: the follower's fetch ends at
    ``config_fetch_deadline_seconds`` (1 s here), and is tried again at its next refresh."""
    pinned = b64(public_bytes(Ed25519PrivateKey.generate().public_key()))
    with handler_served(_Dribbling) as url:
        service, _ = make_service(
            f"sqlite:///{tmp_path / 's.db'}",
            tmp_path,
            analyzer_url=f"{url}/head",
            analyzer_key=pinned,
            config_fetch_deadline_seconds=1.0,
        )
        assert service.follower is not None
        start = time.monotonic()
        with deadline_client(1.0) as http, pytest.raises(FetchDeadlineError):
            service.follower.fetch(http)
    assert time.monotonic() - start < 3.0
