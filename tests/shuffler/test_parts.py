"""Batches in parts (issue 11): stored as bounded signed parts, each sent by exactly one
forwarder at a time (the store's lease), never failed for its size."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from alembic import command
from sqlalchemy import select, text

from common.randomness import SeededSource
from common.wire import Batch, BatchAck
from runtime import db
from shuffler import tables
from shuffler.forwarder import Outcome
from shuffler.service import ShufflerService
from shuffler.store_backends import make_store

from .factory import Clock, fill, make_service, migrations_on

#: 40 contributions of 2 fragments in parts of 7: several parts per batch.
PART_FRAGMENTS = 7


def _ack(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    ack = BatchAck(batch_id=body["batch_id"], part=body["part"], duplicate=False)
    return httpx.Response(201, content=ack.model_dump_json())


def _closed(
    database_url: str, tmp_path: Path, **overrides: object
) -> tuple[ShufflerService, Clock]:
    service, clock = make_service(
        database_url,
        tmp_path,
        rng=SeededSource(11),
        analyzer_url="http://analyzer.test/",
        part_fragments=PART_FRAGMENTS,
        backoff_base_seconds=1.0,
        backoff_cap_seconds=4.0,
        **overrides,
    )
    fill(service, clock.epoch, 40)
    service.close("homepage", clock.epoch)
    return service, clock


def _bodies(service: ShufflerService) -> list[Batch]:
    with service.store.engine.connect() as conn:
        rows = conn.execute(select(tables.part_bodies.c.body)).scalars()
        return [Batch.model_validate_json(body) for body in rows]


def test_a_batch_is_stored_as_bounded_parts_and_forwarded_when_all_are_in(
    database_url: str, tmp_path: Path
) -> None:
    service, _ = _closed(database_url, tmp_path)
    parts = _bodies(service)
    kept = parts[0].n_contributions
    # The streamed shuffle cuts where data-independent coins say (shuffler.dealing): at least
    # ceil(F / cap) parts, each within the cap, numbered 0..parts-1.
    assert len(parts) == parts[0].parts >= -(-2 * kept // PART_FRAGMENTS) > 1
    assert sorted(p.part for p in parts) == list(range(len(parts)))
    assert all(0 < len(p.fragments) <= PART_FRAGMENTS for p in parts)
    assert sum(len(p.fragments) for p in parts) == 2 * kept
    refused = {1}  # the analyzer is briefly unavailable for part 1 only

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["part"] in refused:
            refused.clear()
            return httpx.Response(503)
        return _ack(request)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        assert service.forward_due(client)["retried"] == 1
        ledger = service.ledger()  # one part missing: the batch is not forwarded yet
        assert ledger["in_batches_forwarded"] == 0 and ledger["in_batches_unforwarded"] == kept
        service.clock.now += 10  # type: ignore[attr-defined]
        assert service.forward_due(client) == {"forwarded": 1, "retried": 0, "failed": 0}
    assert service.ledger()["in_batches_forwarded"] == kept


def test_a_claimed_part_is_not_claimed_again_until_its_lease_expires(
    database_url: str, tmp_path: Path
) -> None:
    service, clock = _closed(database_url, tmp_path)
    store = service.store
    key = store.due_parts(clock.now)[0]
    assert store.claim(key, clock.now, 60.0) is not None
    assert store.claim(key, clock.now + 1, 60.0) is None
    assert key not in store.due_parts(clock.now + 1)
    assert store.claim(key, clock.now + 61, 60.0) is not None  # its forwarder died
    store.record_forwarded(key, clock.now + 62)
    assert store.claim(key, clock.now + 200, 60.0) is None


def test_a_lease_left_by_a_crash_is_released_when_a_sqlite_shuffler_starts(
    database_url: str, tmp_path: Path
) -> None:
    """A crash between a part's claim and its outcome (fault 7, docs/reliability.md) leaves
    the part leased. On SQLite one process writes the file (its writer lock), so the next
    start releases every lease and sends the part at once instead of after the lease
    (``forward_lease_seconds``, two minutes by default); on PostgreSQL another replica may
    hold the lease, so it runs out."""
    service, clock = _closed(database_url, tmp_path)
    store = service.store
    key = store.due_parts(clock.now)[0]
    assert store.claim(key, clock.now, 120.0) is not None
    store.close()  # the crashed process's writer lock is gone with it
    restarted = make_store(db.make_engine(database_url))
    restarted.claim_file()
    restarted.start_writing()
    try:
        released = key in restarted.due_parts(clock.now + 1)
        assert released == database_url.startswith("sqlite")
    finally:
        restarted.close()


def test_two_forwarders_racing_deliver_each_part_once(database_url: str, tmp_path: Path) -> None:
    """The periodic loop and an admin close (two threads, two connections) over one store."""
    service, _ = _closed(database_url, tmp_path)
    parts = len(_bodies(service))
    seen: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()

    def slow_ack(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with lock:
            seen[(body["batch_id"], body["part"])] += 1
        time.sleep(0.02)  # keep both forwarders inside a round together
        return _ack(request)

    def forward() -> None:
        with httpx.Client(transport=httpx.MockTransport(slow_ack)) as client:
            service.forwarder.forward_due(client)

    threads = [threading.Thread(target=forward) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == parts and set(seen.values()) == {1}
    assert service.ledger()["in_batches_forwarded"] == _bodies(service)[0].n_contributions


@pytest.mark.parametrize("status", [413, 401, 404])
def test_size_and_configuration_refusals_are_retried_not_failed(
    database_url: str, tmp_path: Path, status: int
) -> None:
    """docs/protocol.md, "Delivery guarantees": no batch is ever dropped for its size."""
    service, clock = _closed(database_url, tmp_path)
    parts = len(_bodies(service))
    refuse = httpx.MockTransport(lambda _: httpx.Response(status, json={"error": "x"}))
    with httpx.Client(transport=refuse) as client:
        assert service.forward_due(client)[Outcome.RETRIED] == parts
    clock.now += 10
    with httpx.Client(transport=httpx.MockTransport(_ack)) as client:
        assert service.forward_due(client)[Outcome.FORWARDED] == parts
    assert service.events.get("batches_failed") == 0


def test_migration_moves_a_stored_batch_into_part_0_of_1(database_url: str) -> None:
    """A batch stored before parts existed (revision 0001) is sent unchanged after upgrade
    (its body in ``part_bodies`` since 0004), and a downgrade puts it back."""
    engine = db.make_engine(database_url)
    with engine.begin() as conn:
        config = migrations_on(conn)
        command.upgrade(config, "0001")
        conn.execute(
            text(
                "INSERT INTO batches (batch_id, channel_id, epoch, n_contributions, body,"
                " signature, status, created_at, attempts, next_attempt_at) VALUES"
                " ('ab', 'homepage', 3, 9, :body, 'sig', 'pending', 1.0, 2, 5.0)"
            ),
            {"body": b"{}"},
        )
        command.upgrade(config, "head")
        part = conn.execute(select(tables.batch_parts)).one()
        stored = conn.execute(select(tables.part_bodies.c.body)).scalar_one()
        batch = conn.execute(select(tables.batches)).one()
        command.downgrade(config, "0001")
        body = conn.execute(text("SELECT body FROM batches")).scalar_one()
    engine.dispose()
    assert (part.batch_id, part.part, bytes(stored), part.attempts) == ("ab", 0, b"{}", 2)
    assert (batch.parts, batch.n_contributions, batch.status) == (1, 9, "pending")
    assert bytes(body) == b"{}"
