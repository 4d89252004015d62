"""Forwarding over a mock analyzer: acknowledged batches are done, retryable answers back off
(honouring Retry-After), permanent refusals fail the batch; nothing is dropped or re-sent early."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from common.preauth import PreauthError, parse_preauth
from common.randomness import SeededSource
from common.wire import BatchAck
from shuffler.forwarder import Outcome
from shuffler.service import ShufflerService

from .factory import Clock, fill, make_service

Handler = Callable[[httpx.Request], httpx.Response]


def _client(handler: Handler, seen: list[httpx.Request]) -> httpx.Client:
    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    return httpx.Client(transport=httpx.MockTransport(record))


def _ack(request: httpx.Request) -> httpx.Response:
    batch_id = json.loads(request.content)["batch_id"]
    ack = BatchAck(batch_id=batch_id, duplicate=False, fragments=1)
    return httpx.Response(201, content=ack.model_dump_json())


def _ready(database_url: str, tmp_path: Path) -> tuple[ShufflerService, Clock]:
    service, clock = make_service(
        database_url,
        tmp_path,
        rng=SeededSource(5),
        analyzer_url="http://analyzer.test/",
        backoff_base_seconds=2.0,
        backoff_cap_seconds=8.0,
    )
    fill(service, clock.epoch, 40)
    service.close("homepage", clock.epoch)
    return service, clock


def test_acknowledged_batch_is_forwarded_once(database_url: str, tmp_path: Path) -> None:
    service, clock = _ready(database_url, tmp_path)
    seen: list[httpx.Request] = []
    with _client(_ack, seen) as client:
        assert service.forward_due(client) == {"forwarded": 1, "retried": 0, "failed": 0}
        assert service.forward_due(client) == {"forwarded": 0, "retried": 0, "failed": 0}
    assert [str(r.url) for r in seen] == ["http://analyzer.test/v1/batches"]
    assert seen[0].headers["ESA-Signature"] and service.ledger()["in_batches_forwarded"] > 0
    assert seen[0].headers["ESA-Shuffler"] == "shuffler-1"  # the analyzer picks the key by it
    head = parse_preauth(seen[0].headers["ESA-Preauth"])  # what takes the analyzer's slot
    head.check("shuffler-1", service.signing_key.public_key(), clock.now)
    head.check_body(seen[0].content)
    with pytest.raises(PreauthError):
        head.check("shuffler-2", service.signing_key.public_key(), clock.now)


def test_retryable_answers_back_off_then_succeed(database_url: str, tmp_path: Path) -> None:
    service, clock = _ready(database_url, tmp_path)
    answers = iter(
        [
            httpx.Response(503),
            httpx.Response(429, headers={"Retry-After": "30"}),
        ]
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        return next(answers, None) or _ack(request)

    with _client(handler, seen) as client:
        assert service.forward_due(client)["retried"] == 1
        assert service.forward_due(client)["retried"] == 0  # not due yet
        clock.now += 3.0  # base 2 s, jitter in [0.5, 1.5)
        assert service.forward_due(client)["retried"] == 1
        clock.now += 16.0  # backoff would allow it; Retry-After not
        assert service.forward_due(client) == {"forwarded": 0, "retried": 0, "failed": 0}
        clock.now += 15.0
        assert service.forward_due(client)["forwarded"] == 1
    assert len({r.content for r in seen}) == 1  # the same signed bytes every time


def test_permanent_refusal_fails_the_batch(database_url: str, tmp_path: Path) -> None:
    service, clock = _ready(database_url, tmp_path)
    seen: list[httpx.Request] = []
    with _client(lambda _: httpx.Response(422, json={"error": "x", "detail": "y"}), seen) as client:
        assert service.forward_due(client)[Outcome.FAILED] == 1
        clock.now += 3600
        assert service.forward_due(client)[Outcome.FAILED] == 0
    assert len(seen) == 1 and service.events.get("batches_failed") == 1
    ledger = service.ledger()
    assert ledger["in_batches_refused"] > 0 and ledger["in_batches_unforwarded"] == 0


def test_transport_errors_are_retried(database_url: str, tmp_path: Path) -> None:
    service, _ = _ready(database_url, tmp_path)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with _client(refuse, []) as client:
        assert service.forward_due(client)["retried"] == 1
