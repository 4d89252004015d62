"""The load test's drain (``services.tools.loadtest.verify.drain``) waits for a service that
does not answer for a while, within its timeout, instead of failing the verification at once:
fault 2 of issue 49 (docs/reliability.md) restarts the analyzer, and a restart under load can
outlast the run, so the drain begins while nothing listens at the analyzer's port yet.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from runtime.conservation import LEDGER_CONTRIBUTIONS
from services.tools.credentials import Credentials
from services.tools.loadtest import verify

#: A drained shuffler's /metrics: its ledger, no queue.
SHUFFLER = (
    f'{LEDGER_CONTRIBUTIONS}{{state="forwarded"}} 10\n'
    'esa_shuffler_queue_depth{state="pending"} 0\n'
    'esa_shuffler_queue_depth{state="in_batches_unforwarded"} 0\n'
)
#: A drained analyzer's /metrics.
ANALYZER = "esa_analyzer_parts_unopened 0\n"


def _handler(text: str) -> type[BaseHTTPRequestHandler]:
    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Metrics


@contextmanager
def _server(text: str, listen_after: float = 0.0) -> Iterator[str]:
    """A real HTTP server answering ``text``; its port is bound at once but listens only
    after ``listen_after`` seconds (until then a connection is refused, as while a service
    restarts)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(text), bind_and_activate=False)
    server.server_bind()
    done, listening = threading.Event(), threading.Event()

    def serve() -> None:
        if done.wait(listen_after):
            return  # over before it listened
        server.server_activate()
        listening.set()
        server.serve_forever(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        done.set()
        if listening.is_set():
            server.shutdown()
        thread.join(5)
        server.server_close()


def test_the_drain_waits_for_an_analyzer_that_is_not_listening_yet() -> None:
    tokens = Credentials.shared("t")
    with _server(SHUFFLER) as shuffler, _server(ANALYZER, listen_after=1.5) as analyzer:
        took = verify.drain(analyzer, [shuffler], tokens, timeout=30)
    assert took >= 1.0  # it waited (connections refused first), then found all drained


def test_the_drain_says_which_service_never_answered() -> None:
    tokens = Credentials.shared("t")
    with (
        _server(SHUFFLER) as shuffler,
        _server(ANALYZER, listen_after=60) as analyzer,
        pytest.raises(verify.VerifyError, match=f"not drained after 1 s: metrics of {analyzer}"),
    ):
        verify.drain(analyzer, [shuffler], tokens, timeout=1)


class _NotStartedYet(BaseHTTPRequestHandler):
    """A shuffler's admin close that answers ``epoch_not_started`` to the first
    ``refusals`` requests (the run ended before the epoch it sealed requests for began)."""

    refusals = 2
    closes: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        type(self).closes.append(self.rfile.read(int(self.headers["Content-Length"])))
        started = len(type(self).closes) > type(self).refusals
        status, body = (200, b'{"closed": 1}') if started else (409, NOT_STARTED)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


NOT_STARTED = b'{"error":"epoch_not_started","detail":"epoch 9 has not started"}'


@contextmanager
def _closer(refusals: int) -> Iterator[str]:
    _NotStartedYet.refusals, _NotStartedYet.closes = refusals, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotStartedYet)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_epoch_not_started_yet_is_closed_once_it_starts() -> None:
    with _closer(refusals=2) as url:
        verify.close_epochs([url], Credentials.shared("t"), {"ticks": [9]})
    assert len(_NotStartedYet.closes) == 3


def test_an_epoch_that_never_starts_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify, "NOT_STARTED_PATIENCE_SECONDS", 1.0)
    with _closer(refusals=10**6) as url, pytest.raises(verify.VerifyError, match="not_started"):
        verify.close_epochs([url], Credentials.shared("t"), {"ticks": [9]})
