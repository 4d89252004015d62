"""``runtime.db.run_tx``, the one way into a transaction (docs/architecture.md, "Storage"), on
real SQLite and PostgreSQL: a failure the backend calls retryable (SQLite's write lock not
granted in time, PostgreSQL's serialization failure, both caused for real by a second
connection) is run again and counted ``retried`` then ``committed``; a unique-constraint
violation is raised at once (nothing of the attempt kept) and counted ``failed``, unless the
caller asks for it to be retried; ``attempts=1`` runs once. Then the counter as the shuffler's
``/metrics`` serves it: fixed names, none of the batching transactions (docs/shuffler.md,
"Metrics")."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError

from analyzer.metrics import AnalyzerEvents, EventsCollector
from runtime import db
from shuffler.app import create_app
from shuffler.settings import ShufflerSettings

from ..shuffler.factory import EPOCH_SECONDS, POLICY, fill, make_service

METADATA = MetaData()
ROWS = Table(
    "rows",
    METADATA,
    Column("id", Integer, primary_key=True),
    Column("value", String, nullable=False),
)
#: The shuffler's transactions whose counts would follow group sizes: never counted.
BATCHING = {
    "shuffler.record_group",
    "shuffler.stage_part",
    "shuffler.unstage",
    "shuffler.sweep",
    "shuffler.close_epoch",
    "shuffler.barrier",
}
METRICS_TOKEN = "metrics-secret"


@pytest.fixture
def engine(database_url: str) -> Engine:
    """A fresh database with one row (id 1); SQLite waits 0.1 s for its write lock."""
    made = db.make_engine(database_url, busy_timeout=0.1)
    METADATA.create_all(made)
    with made.begin() as conn:
        conn.execute(insert(ROWS).values(id=1, value="first"))
    return made


def _counts(name: str) -> tuple[int, int, int]:
    return tuple(db.TRANSACTIONS.get(name, outcome) for outcome in db.TX_OUTCOMES)  # type: ignore[return-value]


def _collide(engine: Engine, conn: Connection) -> None:
    """Make ``conn``'s next write fail the way its backend asks to retry: on SQLite another
    connection holds the write lock past the busy timeout (released after the failure); on
    PostgreSQL another transaction updates the row ``conn`` read in its repeatable-read
    snapshot."""
    if db.is_sqlite(engine):
        blocker = sqlite3.connect(str(engine.url.database), isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(update(ROWS).where(ROWS.c.id == 1).values(value="mine"))
        finally:
            blocker.rollback()
            blocker.close()
        return
    conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute(select(ROWS.c.value).where(ROWS.c.id == 1)).one()  # the snapshot
    with engine.begin() as other:
        other.execute(update(ROWS).where(ROWS.c.id == 1).values(value="theirs"))
    conn.execute(update(ROWS).where(ROWS.c.id == 1).values(value="mine"))


def test_a_retryable_failure_is_run_again_and_counted(engine: Engine) -> None:
    name = "test.retryable"
    before = _counts(name)
    calls = []

    def body(conn: Connection) -> str:
        calls.append(len(calls))
        if len(calls) == 1:
            _collide(engine, conn)
        conn.execute(update(ROWS).where(ROWS.c.id == 1).values(value="mine"))
        return "done"

    assert db.run_tx(engine, name, body, backoff=0.0) == "done"
    assert len(calls) == 2
    committed, retried, failed = (a - b for a, b in zip(_counts(name), before, strict=True))
    assert (committed, retried, failed) == (1, 1, 0)
    with engine.connect() as conn:
        assert conn.execute(select(ROWS.c.value)).scalar_one() == "mine"


def test_a_retryable_failure_with_one_attempt_is_raised_at_once(engine: Engine) -> None:
    name = "test.once"
    before = _counts(name)
    calls = []

    def body(conn: Connection) -> None:
        calls.append(1)
        _collide(engine, conn)

    with pytest.raises(OperationalError) as raised:
        db.run_tx(engine, name, body, attempts=1)
    assert db.retryable(raised.value)
    assert len(calls) == 1
    assert tuple(a - b for a, b in zip(_counts(name), before, strict=True)) == (0, 0, 1)


def test_a_constraint_violation_is_raised_at_once_and_nothing_is_kept(engine: Engine) -> None:
    name = "test.duplicate"
    before = _counts(name)
    calls = []

    def body(conn: Connection) -> None:
        calls.append(1)
        conn.execute(insert(ROWS).values(id=2, value="kept?"))
        conn.execute(insert(ROWS).values(id=1, value="duplicate"))

    with pytest.raises(IntegrityError) as raised:
        db.run_tx(engine, name, body)
    assert not db.retryable(raised.value)
    assert len(calls) == 1
    assert tuple(a - b for a, b in zip(_counts(name), before, strict=True)) == (0, 0, 1)
    with engine.connect() as conn:
        assert conn.execute(select(ROWS.c.id)).scalars().all() == [1]  # rolled back


def test_a_callers_own_error_is_retried_up_to_its_attempts(engine: Engine) -> None:
    name = "test.retry_on"
    before = _counts(name)
    calls = []
    lock = threading.Lock()

    def body(conn: Connection) -> None:
        assert lock.locked()  # held for each attempt
        calls.append(1)
        conn.execute(insert(ROWS).values(id=1, value="duplicate"))

    with pytest.raises(IntegrityError):
        db.run_tx(
            engine, name, body, attempts=3, retry_on=(IntegrityError,), backoff=0.0, lock=lock
        )
    assert len(calls) == 3 and not lock.locked()
    assert tuple(a - b for a, b in zip(_counts(name), before, strict=True)) == (0, 2, 1)


def test_an_uncounted_transaction_leaves_the_counter_alone(engine: Engine) -> None:
    before = db.TRANSACTIONS.snapshot()
    assert db.run_tx(engine, "test.uncounted", lambda conn: 7, counted=False) == 7
    assert db.TRANSACTIONS.snapshot() == before


def _scrape(url: str, tmp_path: Path) -> dict[tuple[str, str], float]:
    """``esa_db_transactions_total`` as a real shuffler app serves it: (name, outcome) →
    value."""
    settings = ShufflerSettings(
        database_url=url,
        key_dir=tmp_path / "app-keys",
        channels=[POLICY],
        metrics_token=METRICS_TOKEN,
    )
    with TestClient(create_app(settings)) as client:
        scrape = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert scrape.status_code == 200
    return {
        (sample.labels["name"], sample.labels["outcome"]): sample.value
        for family in text_string_to_metric_families(scrape.text)
        if family.name == db.TRANSACTIONS_METRIC
        for sample in family.samples
        if sample.name == f"{db.TRANSACTIONS_METRIC}_total"
    }


def test_the_shuffler_serves_its_transactions_but_never_its_batching_ones(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    service, clock = make_service(url, tmp_path)
    fill(service, clock.epoch, 30)
    clock.now = (clock.epoch + 1) * EPOCH_SECONDS + 10
    assert service.run_batching() == 1  # a group recorded, its parts staged: none counted
    assert not BATCHING & {name for name, _ in db.TRANSACTIONS.snapshot()}
    service.store.close()  # lets go of the file's writer lock: the app below writes to it
    service.store.engine.dispose()
    served = _scrape(url, tmp_path)
    assert served[("shuffler.release_leases", "committed")] >= 1  # the app's start
    assert all(name.startswith("shuffler.") for name, _ in served)
    assert not BATCHING & {name for name, _ in served}
    assert {outcome for _, outcome in served} <= set(db.TX_OUTCOMES)


def test_the_analyzer_serves_its_own_transactions_only(engine: Engine) -> None:
    db.run_tx(engine, "analyzer.test_probe", lambda conn: None)
    db.run_tx(engine, "shuffler.test_probe", lambda conn: None)
    collector = EventsCollector(AnalyzerEvents(), backlog=lambda: 0)
    served = {
        (sample.labels["name"], sample.labels["outcome"])
        for family in collector.collect()
        if family.name == db.TRANSACTIONS_METRIC
        for sample in family.samples
    }
    assert ("analyzer.test_probe", "committed") in served
    assert all(name.startswith("analyzer.") for name, _ in served)
