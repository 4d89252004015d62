"""The raw ingest route: group commit, and the same error contract as every other route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy.exc import OperationalError

from shuffler.errors import ClientRateLimitedError, ShufflerStorageError, TooManyFragmentsError
from shuffler.ingest import CommitQueue, Ingest, refused
from shuffler.records import Pending
from shuffler.service import Stored

from .factory import make_service, pending, sealed


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
