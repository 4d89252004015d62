"""The background opener over both backends (issue 11): it pages past parts it must skip, a part
whose opening keeps failing is quarantined after a bounded number of attempts (never folded in,
never blocking the others, visible in the store, the metrics and every release), and failures
of the database itself are not counted against any part."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from analyzer.channels import ChannelRuntime
from analyzer.errors import NothingReceivedError
from analyzer.metrics import EventsCollector
from analyzer.opening import OPEN_ATTEMPTS, FragmentOpener, OpeningTask, PartOpener
from analyzer.service import MIGRATIONS
from analyzer.store import PENDING_PAGE, BatchProgress, PartHeader, PartStatus
from common.envelope import FragmentContext, KeyRing, seal_fragment, sign
from common.mechanisms import krr
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig, b64
from runtime import db

from ..support import wait_until
from .helpers import (
    CHANNEL,
    SHUFFLERS,
    VALUES,
    Layers,
    build,
    estimated,
    make_batch,
    reports,
    seal,
    signed,
)

OTHER = CHANNEL.model_copy(update={"id": "settings-page"})
#: The context the pool tests seal and open with.
CONTEXT = FragmentContext(CHANNEL.id, 7, "")


def _header(body: bytes) -> PartHeader:
    batch = Batch.model_validate_json(body)
    return PartHeader(
        batch_id=batch.batch_id,
        part=batch.part,
        parts=batch.parts,
        shuffler_id=batch.shuffler_id,
        channel_id=batch.channel_id,
        crowd_id=batch.crowd_id,
        epoch=batch.epoch,
        n_contributions=batch.n_contributions,
        n_fragments=len(batch.fragments),
    )


def _halves(body: bytes) -> list[bytes]:
    """A signed batch body cut into 2 parts (bodies only)."""
    batch = Batch.model_validate_json(body)
    half = len(batch.fragments) // 2
    return [
        batch.model_copy(
            update={"part": i, "parts": 2, "fragments": batch.fragments[i * half : (i + 1) * half]}
        ).body()
        for i in range(2)
    ]


def _metrics(layers: Layers) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EventsCollector(layers.events, layers.store.unopened_parts))
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("esa_analyzer_") and "{" not in line:
            name, value = line.split()
            values[name.removeprefix("esa_analyzer_")] = float(value)
    return values


def test_the_opener_pages_past_parts_of_channels_no_longer_configured(database_url: str) -> None:
    layers = build(database_url, (CHANNEL, OTHER))
    runtimes = {CHANNEL.id: ChannelRuntime.build(CHANNEL, sorted(SHUFFLERS))}
    opener = PartOpener(
        layers.store, runtimes, FragmentOpener(layers.opener.opener.ring, 1, 500), layers.events
    )
    # More than a page of the oldest parts belong to a channel this opener does not know.
    chaff = [b64(os.urandom(100))] * 4
    for i in range(PENDING_PAGE + 1):
        batch = Batch(
            batch_id=os.urandom(16).hex(),
            shuffler_id="shuffler-1",
            channel_id=OTHER.id,
            crowd_id="",
            epoch=100 + i,  # one batch per group
            n_contributions=OTHER.min_crowd,
            fragments=chaff,
        )
        layers.intake.accept(*signed(batch))
    layers.intake.accept(*make_batch(VALUES[:200]))
    assert opener.open_pending() == 1
    assert layers.store.unopened_parts() == PENDING_PAGE + 1
    assert layers.store.quarantined_parts() == 0
    assert opener.open_pending() == 0
    layers.closer.close_due()
    assert layers.releases.release(CHANNEL.id, 7, 7).estimate.n == estimated(VALUES[:200])


def test_a_part_that_keeps_failing_is_quarantined_and_never_blocks_the_others(
    database_url: str,
) -> None:
    layers = build(database_url)
    body = make_batch(VALUES[:400], seed=1).body
    first, second = _halves(body)
    layers.intake.accept(first, b64(sign(first, SHUFFLERS["shuffler-1"])), "shuffler-1")
    broken = _header(second)
    # The stored body of part 1 is damaged (it no longer parses): every opening raises.
    assert layers.store.store_part(broken, second[: len(second) // 2], lambda _: None)
    later = make_batch(VALUES[400:], seed=2, shuffler="shuffler-2")  # after the damaged part
    layers.intake.accept(*later)
    assert layers.opener.open_pending() == 2  # part 0 and the later batch: nothing waits behind
    status = layers.store.part_status(broken)
    assert status is not None and status.status == "stored" and status.attempts == 1
    assert status.last_error is not None and status.last_error.startswith("ValidationError")
    for _ in range(OPEN_ATTEMPTS - 1):
        assert layers.opener.open_pending() == 0
    status = layers.store.part_status(broken)
    assert status is not None and status.status == "quarantined"
    assert status.attempts == OPEN_ATTEMPTS
    assert layers.opener.open_pending() == 0  # never tried again
    assert layers.store.part_status(broken) == status
    metrics = _metrics(layers)
    assert metrics["parts_quarantined"] == 1 and metrics["parts_unopened"] == 0
    assert metrics["part_open_failures_total"] == OPEN_ATTEMPTS
    assert metrics["parts_opened_total"] == 2 and metrics["batches_accepted_total"] == 1
    # Its batch stays incomplete: the release uses the other batch only, and says why.
    assert layers.store.incomplete(CHANNEL.id, "", 7, 7) == {
        broken.batch_id: BatchProgress(1, 2, 1)
    }
    layers.closer.close_due()
    release = layers.releases.release(CHANNEL.id, 7, 7)
    assert release.estimate.n == estimated(VALUES[400:], 2)
    assert f"{broken.batch_id} (1/2 parts, 1 quarantined" in release.to_wire().note
    assert len(layers.store.charges(CHANNEL.id)) == 1
    assert layers.store.charges(CHANNEL.id)[0].batches == 1


@pytest.mark.slow
def test_a_database_failure_is_not_counted_against_the_part(tmp_path: Path) -> None:
    path = tmp_path / "analyzer.db"
    layers = build(f"sqlite:///{path}")
    layers.intake.accept(*make_batch(VALUES[:300]))
    # Another process holds the write lock: folding the part in fails with "database is
    # locked" after the busy timeout; the part keeps its clean record.
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(OperationalError, match="locked"):
            layers.opener.open_pending()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    (header,) = layers.store.pending_parts()
    assert layers.store.part_status(header) == PartStatus("stored", 0, None)
    assert layers.events.get("part_open_failures") == 0
    assert layers.opener.open_pending() == 1
    layers.closer.close_due()
    assert layers.releases.release(CHANNEL.id, 7, 7).estimate.n == estimated(VALUES[:300])


def _deliver_halves(layers: Layers, batches: int) -> None:
    """Store ``batches`` batches of 200 contributions, one per shuffler, each in 2 parts."""
    for i, shuffler in enumerate(sorted(SHUFFLERS)[:batches]):
        body = make_batch(VALUES[200 * i : 200 * (i + 1)], seed=i, shuffler=shuffler).body
        for half in _halves(body):
            layers.intake.accept(half, b64(sign(half, SHUFFLERS[shuffler])), shuffler)


def _halves_crowd(batches: int) -> int:
    """The crowd the analyzer's estimate rests on for :func:`_deliver_halves`'s batches (an
    odd fragment left out of both halves)."""
    total = 0
    for i in range(batches):
        values = VALUES[200 * i : 200 * (i + 1)]
        total += estimated(values, i, kept=len(reports(values, i)) // 2 * 2)
    return total


class _Taken:
    """Wraps ``store.opening``, counting the parts whose lock is held now. A class: a lock a
    pass leaked is never released by garbage collection (a generator's would be), so the
    count shows it while the failure's traceback keeps the pass's frame alive."""

    def __init__(self, store: Any) -> None:
        self.opening, self.held = store.opening, 0

    def __call__(self, header: PartHeader) -> _Taken:
        self._inner = self.opening(header)
        return self

    def __enter__(self) -> bool:
        mine = bool(self._inner.__enter__())
        self.held += 1
        return mine

    def __exit__(self, *exc: Any) -> Any:
        self.held -= 1
        return self._inner.__exit__(*exc)


def test_the_pool_opens_the_next_part_while_the_one_in_hand_is_folded(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = build(database_url)
    _deliver_halves(layers, 3)
    pool = FragmentOpener(layers.opener.opener.ring, 1, 50)  # in this process: the same calls
    opener = PartOpener(layers.store, layers.opener.channels, pool, layers.events)
    steps: list[str] = []
    submit, fold = pool.submit, layers.store.fold_part

    def submitted(context: FragmentContext, texts: list[str]) -> OpeningTask:
        steps.append("submit")
        return submit(context, texts)

    def folded(*args: Any, **kwargs: Any) -> Any:
        steps.append("fold")
        return fold(*args, **kwargs)

    monkeypatch.setattr(pool, "submit", submitted)
    monkeypatch.setattr(layers.store, "fold_part", folded)
    taken = _Taken(layers.store)
    monkeypatch.setattr(layers.store, "opening", taken)
    assert opener.open_pending() == 6
    assert steps == ["submit"] + ["submit", "fold"] * 5 + ["fold"]
    assert taken.held == 0
    assert layers.releases.release(CHANNEL.id, 7, 7).estimate.n == _halves_crowd(3)


@pytest.mark.parametrize("fails", ["fold_part", "part_body"])
def test_a_database_failure_with_a_part_opened_ahead_leaves_no_part_taken(
    database_url: str, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """The database fails folding part 0 once part 1 is started (``fold_part``), or reading
    part 1 while part 0 is in hand (``part_body``): both parts' locks are released, no part
    is blamed, and the next pass folds every part."""
    layers = build(database_url)
    _deliver_halves(layers, 2)
    taken = _Taken(layers.store)
    monkeypatch.setattr(layers.store, "opening", taken)
    real, calls = getattr(layers.store, fails), []

    def connection_lost(*args: Any, **kwargs: Any) -> Any:
        calls.append(fails)
        if fails == "part_body" and len(calls) == 1:
            return real(*args, **kwargs)  # part 0 is read; reading part 1 fails
        raise OperationalError("SELECT", {}, Exception("connection lost"))

    monkeypatch.setattr(layers.store, fails, connection_lost)
    with pytest.raises(OperationalError) as raised:
        layers.opener.open_pending()
    assert raised.value is not None and taken.held == 0  # the traceback keeps the pass alive
    assert _advisory_locks(layers) == 0
    monkeypatch.setattr(layers.store, fails, real)
    assert layers.opener.open_pending() == 4
    assert layers.events.get("part_open_failures") == 0
    layers.closer.close_due()
    assert layers.releases.release(CHANNEL.id, 7, 7).estimate.n == _halves_crowd(2)


def _advisory_locks(layers: Layers) -> int:
    """Advisory locks held in the test's database (PostgreSQL; SQLite takes none)."""
    if layers.store.engine.dialect.name != "postgresql":
        return 0
    query = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    with layers.store.engine.connect() as conn:
        return int(conn.execute(text(query)).scalar_one())


@pytest.mark.system
def test_a_dead_pool_worker_fails_one_opening_and_the_pool_starts_again() -> None:
    key = X25519PrivateKey.generate()
    texts = [b64(seal_fragment(b"x" * 8, CONTEXT, 16, key.public_key())) for _ in range(40)]
    opener = FragmentOpener(KeyRing.of(key), 2, 10)
    try:
        assert len(opener.open(CONTEXT, texts)) == 40
        pool = opener._pool
        assert pool is not None
        victim = next(iter(pool._processes))
        os.kill(victim, signal.SIGKILL)
        threading.Event().wait(0.5)
        with pytest.raises(BrokenProcessPool):
            opener.open(CONTEXT, texts)
        assert len(opener.open(CONTEXT, texts)) == 40
        # Two parts in flight when a worker dies: both fail, the pool starts again once.
        many = texts * 500  # ~0.5 s of opening each: both still in flight when the worker dies
        first, second = opener.submit(CONTEXT, many), opener.submit(CONTEXT, many)
        broken = opener._pool
        assert broken is not None
        os.kill(next(iter(broken._processes)), signal.SIGKILL)
        with pytest.raises(BrokenProcessPool):
            first.result()
        restarted = opener._pool
        assert restarted is not broken
        with pytest.raises(BrokenProcessPool):
            second.result()
        assert opener._pool is restarted
        assert len(opener.open(CONTEXT, texts)) == 40
    finally:
        opener.close()


@pytest.mark.system
def test_warming_starts_every_pool_worker_before_the_first_part() -> None:
    """The analyzer warms its pool at start-up: every worker process is running (its key
    ring loaded) before any part arrives, and opening then uses those same processes."""
    key = X25519PrivateKey.generate()
    opener = FragmentOpener(KeyRing.of(key), 2, 10)
    try:
        assert opener.warm() == 2
        pool = opener._pool
        assert pool is not None
        started = set(pool._processes)
        assert len(started) == 2 and all(_alive(pid) for pid in started)
        texts = [b64(seal_fragment(b"x" * 8, CONTEXT, 16, key.public_key())) for _ in range(40)]
        assert len(opener.open(CONTEXT, texts)) == 40
        # in the pool as in process: a fragment opens only with its own epoch and crowd
        assert opener.open(FragmentContext(CHANNEL.id, 8, ""), texts) == []
        assert set(pool._processes) == started
    finally:
        opener.close()
    assert FragmentOpener(KeyRing.of(key), 1, 10).warm() == 1  # no pool: opens in-process


def test_migration_turns_the_opened_flag_into_a_status(database_url: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    engine = db.make_engine(database_url)
    columns = (
        "batch_id, part, parts, shuffler_id, channel_id, crowd_id, epoch, n_contributions,"
        " n_fragments, body, opened, invalid, received_at"
    )
    try:
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "0004")
            for batch_id, opened in (("a" * 32, True), ("b" * 32, False)):
                conn.execute(
                    text(
                        f"INSERT INTO batch_parts ({columns}) VALUES (:b, 0, 1, 'shuffler-1',"
                        " 'homepage', '', 7, 50, 3, :body, :opened, 0, 1.0)"
                    ),
                    {"b": batch_id, "body": None if opened else b"{}", "opened": opened},
                )
            command.upgrade(config, "head")
            rows = conn.execute(
                text("SELECT batch_id, status, attempts, last_error FROM batch_parts")
            ).all()
            command.downgrade(config, "0004")
            flags = conn.execute(text("SELECT batch_id, opened FROM batch_parts")).all()
    finally:
        engine.dispose()
    assert sorted(tuple(r) for r in rows) == [
        ("a" * 32, "opened", 0, None),
        ("b" * 32, "stored", 0, None),
    ]
    assert sorted((b, bool(o)) for b, o in flags) == [("a" * 32, True), ("b" * 32, False)]


WORKERS = """
import sys, time
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from analyzer.opening import FragmentOpener
from common.envelope import FragmentContext, KeyRing
opener = FragmentOpener(KeyRing.of(X25519PrivateKey.generate()), 2, 10)
opener.open(FragmentContext("homepage", 7, ""), ["AAAA"] * 40)
print(*opener._pool._processes, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.system
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_pool_workers_end_when_the_analyzer_is_killed() -> None:
    # A crash (kill -9) runs no shutdown: the workers must notice and end on their own.
    analyzer = subprocess.Popen(
        [sys.executable, "-c", WORKERS], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    try:
        assert analyzer.stdout is not None
        workers = [int(pid) for pid in analyzer.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    finally:
        analyzer.kill()
        analyzer.wait()
    wait_until(lambda: not any(_alive(pid) for pid in workers), timeout=60)


REGIONAL = ChannelConfig(
    id="regional",
    mechanism="krr",
    params={"k": 4, "eps": 2.0},
    min_crowd=50,
    max_fragments=1,
    min_fragments=1,
    payload_size=16,
    crowds=("eu", "us"),
)


def _krr_reports(n: int, seed: int) -> list[bytes]:
    params, rng = krr.KRRParams(k=4, eps=2.0), SeededSource(seed)
    return [f for i in range(n) for f in krr.KRR().encode_value(params, i % 4, rng)]


def _krr_part(fragments: list[str], n: int, epoch: int, crowd: str) -> Batch:
    return Batch(
        batch_id=os.urandom(16).hex(),
        shuffler_id="shuffler-1",
        channel_id=REGIONAL.id,
        crowd_id=crowd,
        epoch=epoch,
        n_contributions=n,
        fragments=fragments,
    )


@pytest.mark.parametrize(
    ("epoch", "crowd"), [(7, "eu"), (8, "us")], ids=["earlier-epoch", "other-crowd"]
)
def test_fragments_sealed_for_another_group_do_not_open_and_cost_the_crowd(
    database_url: str, epoch: int, crowd: str
) -> None:
    """A shuffler pads epoch 8's batch for crowd "eu" with 50 reports sealed for another group
    (replayed from epoch 7, or taken from crowd "us"), claiming 250 contributions: the count
    fits (one report each), but the 50 do not open, are counted invalid, and the batch is
    certified and estimated on the 200 contributions its fragments verify, exactly as if the
    shuffler had sent only those."""
    layers = build(database_url, [REGIONAL])
    honest = seal(_krr_reports(200, seed=1), REGIONAL, 8, "eu")
    replayed = seal(_krr_reports(50, seed=2), REGIONAL, epoch, crowd)
    mixed = honest[:100] + replayed + honest[100:]
    layers.deliver(*signed(_krr_part(mixed, 250, 8, "eu")))
    assert layers.events.get("fragments_opened") == 200
    assert layers.events.get("fragments_invalid") == 50
    assert layers.events.get("crowd_shortfall") == 50
    release = layers.releases.release(REGIONAL.id, 8, 8, crowd_id="eu")
    assert release.estimate.n == 200 and release.crowds == {"8/shuffler-1#0": 200}
    check = release.to_wire().crowd_check
    assert check is not None
    assert (check.claimed, check.verified, check.invalid_fragments) == (250, 200, 50)
    if "sqlite" in database_url:  # the same reports, sent honestly
        reference = build(database_url.replace("test.db", "reference.db"), [REGIONAL])
        reference.deliver(*signed(_krr_part(honest, 200, 8, "eu")))
        expected = reference.releases.release(REGIONAL.id, 8, 8, crowd_id="eu")
        assert (release.estimate.values == expected.estimate.values).all()
        assert release.certificate == expected.certificate


def test_a_batch_none_of_whose_fragments_open_releases_nothing(database_url: str) -> None:
    """Every fragment sealed for another epoch: nothing verifies, and the range is no_data
    rather than a release certified on a crowd nobody backs."""
    layers = build(database_url, [REGIONAL])
    replayed = seal(_krr_reports(60, seed=3), REGIONAL, 7, "eu")
    layers.deliver(*signed(_krr_part(replayed, 60, 8, "eu")))
    assert layers.events.get("fragments_invalid") == 60
    with pytest.raises(NothingReceivedError, match=r"can be released: .* verify 0 of"):
        layers.releases.release(REGIONAL.id, 8, 8, crowd_id="eu")
