"""The ingest route: group commit, the same error contract as every other route, and its
place as the server's direct route."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from shuffler import ingest as ingest_module
from shuffler import service as service_module
from shuffler.app import create_asgi
from shuffler.errors import ClientRateLimitedError, ShufflerStorageError, TooManyFragmentsError
from shuffler.ingest import CommitQueue, Ingest, refused
from shuffler.records import Pending
from shuffler.service import Stored
from shuffler.settings import ShufflerSettings

from .factory import POLICY, make_service, pending, sealed


def test_commit_queue_refuses_with_storage_unavailable_when_the_commit_fails(
    tmp_path: Path,
) -> None:
    """A failed group commit stores nothing and answers every request of the batch (no hang)."""
    service, clock = make_service(f"sqlite:///{tmp_path / 'test.db'}", tmp_path)

    def broken(_: Sequence[Pending]) -> list[Stored]:
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    async def run() -> list[Stored]:
        queue = CommitQueue(service, max_batch=8)
        queue.start()
        try:
            good = await queue.submit(pending(service, service.tokens.issue(), clock.epoch))
            service.commit = broken  # type: ignore[method-assign,assignment]
            bad = await asyncio.gather(
                *(
                    queue.submit(pending(service, service.tokens.issue(), clock.epoch))
                    for _ in range(5)
                )
            )
            return [good, *bad]
        finally:
            await asyncio.to_thread(queue.stop)

    good, *bad = asyncio.run(run())
    assert good.receipt
    for stored in bad:
        assert isinstance(stored.refusal, ShufflerStorageError)
        assert stored.refusal.code == "storage_unavailable"


def test_refusals_use_the_shared_status_table_and_body() -> None:
    status, body, headers = refused(ClientRateLimitedError("slow down", retry_after=2.4))
    assert status == 429 and headers == [(b"retry-after", b"2")]
    assert json.loads(body) == {"error": "rate_limited", "detail": "slow down"}
    status, body, headers = refused(TooManyFragmentsError("9 > 8"))
    assert (status, headers) == (413, []) and json.loads(body)["error"] == "too_many_fragments"


def test_ingest_answers_receipts_and_refusals(tmp_path: Path) -> None:
    service, clock = make_service(f"sqlite:///{tmp_path / 'test.db'}", tmp_path)
    token = service.tokens.issue().encode()

    async def post(
        body: bytes, content_type: bytes = b"application/octet-stream"
    ) -> tuple[int, dict[str, str]]:
        writer = CommitQueue(service, max_batch=8)
        writer.start()
        headers = [(b"authorization", b"Bearer " + token), (b"content-type", content_type)]

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            status, data, _ = await Ingest(service, writer)(headers, receive)
        finally:
            await asyncio.to_thread(writer.stop)
        return status, json.loads(data)

    status, answer = asyncio.run(post(sealed(service, clock.epoch)))
    assert status == 202 and len(answer["receipt"]) == 32
    assert asyncio.run(post(sealed(service, clock.epoch)))[1]["error"] == "quota_exceeded"
    assert asyncio.run(post(b"{}", b"application/json"))[1]["error"] == "bad_content_type"
    assert service.events.get("contributions_received") == 1
    assert service.events.get("rejected_quota_exceeded") == 1


def test_only_an_exact_single_bearer_header_is_a_client(tmp_path: Path) -> None:
    """A load balancer picks the replica from the Authorization header as sent, so a padded
    token or a second Authorization header (the balancer hashing one, the service reading
    another) must not be accepted: it would reach another replica's rate-limit bucket with the
    same client (an outside attack through HAProxy got R times the per-client rate so)."""
    service, clock = make_service(f"sqlite:///{tmp_path / 'test.db'}", tmp_path)
    token = service.tokens.issue().encode()

    async def post(authorizations: list[bytes]) -> tuple[int, str]:
        writer = CommitQueue(service, max_batch=8)
        writer.start()
        headers = [(b"authorization", value) for value in authorizations]
        headers.append((b"content-type", b"application/octet-stream"))
        body = sealed(service, clock.epoch)

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            status, data, _ = await Ingest(service, writer)(headers, receive)
        finally:
            await asyncio.to_thread(writer.stop)
        return status, json.loads(data).get("error", "")

    for padded in (b"Bearer  " + token, b"Bearer " + token + b" ", b"Bearer \t" + token):
        assert asyncio.run(post([padded])) == (401, "bad_token")
    assert asyncio.run(post([b"junk", b"Bearer " + token])) == (401, "bad_token")
    assert asyncio.run(post([b"Bearer " + token]))[0] == 202


class _Monotonic:
    """A settable monotonic clock for the rate limiters (the code under test reads
    ``time.monotonic()`` of its own module)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_per_client_state_of_the_ingest_path_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11 item 4 through the real ingest and enrolment paths: one rate-limit bucket per
    client that sent recently, none once a bucket has refilled (burst / rate seconds)."""
    service, _ = make_service(
        f"sqlite:///{tmp_path / 'test.db'}", tmp_path, rate_per_second=5.0, rate_burst=20
    )
    clock = _Monotonic()
    monkeypatch.setattr(ingest_module, "time", clock)
    monkeypatch.setattr(service_module, "time", clock)
    writer = CommitQueue(service, max_batch=8)

    async def post(token: str) -> int:
        headers = [
            (b"authorization", b"Bearer " + token.encode()),
            (b"content-type", b"application/octet-stream"),
        ]

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"not sealed" * 8, "more_body": False}

        return (await Ingest(service, writer)(headers, receive))[0]

    async def crowd_of_clients(count: int) -> list[int]:
        return [await post(service.tokens.issue()) for _ in range(count)]

    assert set(asyncio.run(crowd_of_clients(2_000))) == {400}  # past the rate limit: malformed
    for i in range(500):
        service.enroll(f"10.0.{i // 256}.{i % 256}")
    assert len(service.intake.contributions) == 2_000
    assert len(service.intake.enrolments) == 500
    clock.now += max(
        20 / 5.0, service.intake.enrolments.burst / service.intake.enrolments.rate
    )  # every bucket has refilled: indistinguishable from a fresh one, so forgotten
    asyncio.run(crowd_of_clients(1))
    service.enroll("10.9.9.9")
    assert len(service.intake.contributions) == 1
    assert len(service.intake.enrolments) == 1


def _queue_with(
    items: Sequence[object], recent: int = 0, busy: bool = True, fill: int = 32
) -> CommitQueue:
    """A writer (not started) whose last commit just ended; ``recent``: the size of its
    recent batches; ``busy``: the last one held several requests."""
    writer = CommitQueue(None, max_batch=64, fill=fill, wait=60.0)  # type: ignore[arg-type]
    writer._busy, writer._ended = busy, time.monotonic()
    if recent:
        writer._recent.append(recent)
    for item in items:
        writer._put(item)  # type: ignore[arg-type]
    return writer


def _arrive_later(writer: CommitQueue, items: Sequence[object]) -> threading.Timer:
    def arrive() -> None:
        for item in items:
            writer._put(item)  # type: ignore[arg-type]

    late = threading.Timer(0.05, arrive)
    late.start()
    return late


def test_under_load_a_batch_waits_for_the_requests_that_usually_come_with_it() -> None:
    """The commit window (here up to 60 s, so only the awaited batch can end it): after
    batches of 4, a take that finds 2 requests queued waits for 2 more."""
    writer = _queue_with(["a", "b"], recent=4)
    late = _arrive_later(writer, "cd")
    items, stopping = writer._take()
    late.join()
    assert items == ["a", "b", "c", "d"] and not stopping and writer._busy
    writer = _queue_with(["a", "b"], recent=40, fill=3)
    late = _arrive_later(writer, "c")
    assert writer._take() == (["a", "b", "c"], False)  # never waits for more than ``fill``
    late.join()


def test_no_wait_for_requests_that_are_not_coming() -> None:
    """A client keeping 2 requests in flight is not held for a larger batch; an idle writer
    (last commit long ago, or a lone request last) commits at once; stop() ends a wait."""
    writer = _queue_with(["a", "b"], recent=2)
    assert writer._take() == (["a", "b"], False)
    writer = _queue_with(["a"], recent=4, busy=False)
    assert writer._take() == (["a"], False) and not writer._busy
    writer = _queue_with(["a"], recent=4)
    writer._ended -= 61.0
    assert writer._take() == (["a"], False)
    writer = _queue_with(["a"], recent=4)
    writer._ended -= 2.0  # idle for 2 s: the sizes of earlier batches are forgotten
    assert writer._take() == (["a"], False)
    writer = _queue_with(["a", None], recent=4)
    assert writer._take() == (["a"], True)  # stop() before the take: commit, then stop
    writer = _queue_with(["a"], recent=4)
    late = _arrive_later(writer, [None])
    assert writer._take() == (["a"], True)  # stop() wakes a writer waiting to fill
    late.join()


def test_the_direct_route_is_ingest_for_post_contributions_once_started(tmp_path: Path) -> None:
    """The services' HTTP server asks the app for its direct routes: ``POST
    /v1/contributions`` is the app's :class:`Ingest` (the one its FastAPI route documents and
    serves); nothing else is direct."""
    settings = ShufflerSettings(
        database_url=f"sqlite:///{tmp_path / 'shuffler.db'}",
        key_dir=tmp_path / "keys",
        channels=[POLICY],
    )
    app = create_asgi(settings)
    with TestClient(app):
        ingest = app.direct_route("POST", "/v1/contributions")
        assert isinstance(ingest, Ingest) and ingest is app.app.state.ingest
        for method, path in [("GET", "/v1/contributions"), ("POST", "/v1/enroll")]:
            assert app.direct_route(method, path) is None
