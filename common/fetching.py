"""Reading another party's document over HTTP within a deadline for the whole request.

httpx's timeouts bound each read, not a request: a server that answers one byte every few
seconds holds a fetch as long as it likes. :func:`fetch_within` (a GET) and
:func:`post_within` (a POST: a device's contribution, its enrolment) bound the whole request: no
single connect, write or read may take longer than the deadline, the answer is read in chunks
with the deadline checked between them, and a watchdog shuts the connection's socket down
when the deadline passes (waking a read blocked inside the headers or a chunk). Use it with a
:func:`deadline_client`, which never keeps a connection alive, so every fetch opens the socket
the watchdog watches (a client that reuses one, or no socket at all, is bounded between
chunks only). Name resolution is not covered: name parties by address or by a name the host
resolves locally. Settings and numbers: docs/operations.md, "Fetch deadlines".
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

#: Whole-request deadline (seconds) of a fetch of a signed document (a config, a descriptor).
FETCH_DEADLINE_SECONDS = 5.0
#: Largest config answer read (a config lists the shufflers' descriptors and the channels:
#: kilobytes; read before its signature can be checked).
MAX_CONFIG_BYTES = 8 * 1024 * 1024


class FetchDeadlineError(httpx.TimeoutException):
    """A fetch did not finish within its whole-request deadline (names the URL and seconds)."""


class FetchTooLargeError(ValueError):
    """An answer is larger than the most the reader takes (names the URL and the limit)."""


@dataclass(frozen=True)
class Fetched:
    """One answer read whole: its status, body and headers."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


def deadline_client(
    seconds: float = FETCH_DEADLINE_SECONDS, verify: ssl.SSLContext | bool = True
) -> httpx.Client:
    """A client for :func:`fetch_within`: no kept-alive connections (each fetch connects, so
    its watchdog holds the socket), every timeout ``seconds``."""
    return httpx.Client(
        timeout=seconds,
        verify=verify,
        limits=httpx.Limits(max_keepalive_connections=0),
    )


class _Watchdog:
    """Shuts the fetch's socket down at the deadline (a duplicate descriptor of it: shutting
    it down ends the connection for every descriptor, and ours is closed separately)."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def trace(self, name: str, info: dict[str, Any]) -> None:
        """httpcore's trace hook: keep the socket of each connection opened."""
        if name != "connection.connect_tcp.complete":
            return
        raw = info.get("return_value")
        sock = raw.get_extra_info("socket") if raw is not None else None
        if isinstance(sock, socket.socket):
            with self._lock:
                self._sockets.append(socket.socket(fileno=os.dup(sock.fileno())))
                if self.fired:
                    self._shut()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            self._shut()

    def _shut(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):  # closed already
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


def fetch_within(client: httpx.Client, url: str, limit: int, seconds: float) -> Fetched:
    """GET ``url`` and read its answer whole, at most ``limit`` bytes, all within ``seconds``.

    Raises:
        FetchDeadlineError: the deadline passed (however slowly the other side answered).
        FetchTooLargeError: the answer is longer than ``limit`` bytes.
        httpx.HTTPError: a network failure.
    """
    return _within(client, "GET", url, limit, seconds)


def post_within(
    client: httpx.Client,
    url: str,
    *,
    content: bytes = b"",
    headers: Mapping[str, str] | None = None,
    limit: int,
    seconds: float,
) -> Fetched:
    """POST ``content`` to ``url`` and read the answer whole, at most ``limit`` bytes, sending
    and reading all within ``seconds`` (a server that takes the body or dribbles its answer
    slowly holds the sender no longer).

    Raises:
        FetchDeadlineError: the deadline passed (however slowly the other side read or answered).
        FetchTooLargeError: the answer is longer than ``limit`` bytes.
        httpx.HTTPError: a network failure.
    """
    return _within(client, "POST", url, limit, seconds, content=content, headers=headers)


def _within(
    client: httpx.Client,
    method: str,
    url: str,
    limit: int,
    seconds: float,
    content: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> Fetched:
    """One request of ``method``, its answer read whole within ``seconds`` (see above)."""
    deadline = time.monotonic() + seconds
    late = FetchDeadlineError(f"{method} {url} did not finish within its {seconds:g} s deadline")
    with _Watchdog(seconds) as watchdog:
        try:
            with client.stream(
                method,
                url,
                content=content,
                headers=headers,
                timeout=seconds,
                extensions={"trace": watchdog.trace},
            ) as response:
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise FetchTooLargeError(f"{method} {url} answers over {limit} bytes")
                    if time.monotonic() > deadline:
                        raise late
                status, answer_headers = response.status_code, response.headers
        except httpx.HTTPError as error:
            if error is late:
                raise
            if watchdog.fired or time.monotonic() > deadline:
                raise late from error
            raise
    if time.monotonic() > deadline:
        raise late
    return Fetched(status=status, body=bytes(body), headers=answer_headers)
