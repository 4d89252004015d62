"""Issue 17: shuffler replicas per trust domain and analyzer workers on one PostgreSQL each,
behind HAProxy on loopback, with real processes.

* Two stores of one shuffler on one PostgreSQL database: a group is dealt by one replica at a
  time (the advisory lock) and evaluated once (the groups primary key), whatever the race.
* ``esa up --replicas 2`` without PostgreSQL is refused with a clear message.
* The deployment (``launcher.up``: 2 replicas x 3 shufflers + 2 analyzer workers, HAProxy in
  front): fresh clients contribute through HAProxy while one replica is killed (SIGKILL); an
  admin close at one replica reaches the other (it refuses the closed epoch); one replica and
  one analyzer worker are killed while the batch parts are delivered. Conservation holds per
  shuffler (every contribution that landed is in a forwarded batch or deleted by Algorithm 3,
  0 lost), every group is evaluated once, every part is opened once and every fragment
  accumulated once at the analyzer (0 counted twice).
"""

from __future__ import annotations

import base64
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine

from analyzer import tables as analyzer_tables
from analyzer.channels import ChannelRuntime
from common.envelope import (
    Contribution,
    load_x25519_public,
    new_nonce,
    seal_contribution,
)
from common.randomness import SeededSource
from runtime import db
from runtime import db as runtime_db
from services.cli import launcher
from services.cli.servers import up_command
from shuffler import tables
from shuffler.records import GroupKey
from shuffler.store_backends import group_lock_identity, make_store

from ..shuffler.factory import fill, make_service
from ..support import LONG_EPOCH_CHANNEL, TEST_SHUFFLER_SETTINGS, own_headers, wait_until
from .forge import FreshReports

SHUFFLERS = 3
REPLICAS = 2
WORKERS = 2
CHANNEL = LONG_EPOCH_CHANNEL  # the test never straddles an epoch boundary
INGEST_SECONDS = 4.0
#: Contributions each shuffler must have landed before ingest stops. Its group must be
#: released (the ledgers must show nothing held): Algorithm 3 keeps n - 8.4 + Laplace(0.5),
#: whose k-RAPPOR fragments (1.33 each) must verify min_crowd 5 at alpha 1e-9 (23 fragments).
#: Held with probability 0.70 at n = 25, 0.02 at 30, 4.7e-6 at 35, 2.5e-8 (the abort) at 40:
#: ``landed >= min_crowd``, the old check, left a slow runner's run to chance.
LANDED = 40
#: Tiny parts: a batch is delivered as dozens of POSTs, so a kill lands mid-delivery.
PART_FRAGMENTS = 5
#: Answers a client retries (HAProxy with no replica up yet, a replica killed mid-request).
RETRIED = {502, 503, 504}
OCTETS = "application/octet-stream"


def test_two_replicas_deal_and_evaluate_a_group_once(postgres_url: str, tmp_path: Path) -> None:
    first, clock = make_service(postgres_url, tmp_path / "r1", rng=SeededSource(1))
    second, _ = make_service(postgres_url, tmp_path / "r2", rng=SeededSource(2))  # same time
    fill(first, clock.epoch, 40)
    first.store.close_epoch("homepage", clock.epoch, clock.now)
    key = GroupKey("homepage", "", clock.epoch)
    # A replica dealing the group holds its advisory lock: the other skips it, dealing nothing.
    with first.store.engine.connect() as held:
        held.execute(
            text("SELECT pg_advisory_lock(:k)"),
            {"k": runtime_db.lock_key(group_lock_identity(key))},
        )
        assert second.run_batching() == 0
        parts = tables.batch_parts.c
        assert held.execute(select(func.count()).where(parts.status == "staged")).scalar() == 0
        held.execute(
            text("SELECT pg_advisory_unlock(:k)"),
            {"k": runtime_db.lock_key(group_lock_identity(key))},
        )
        held.commit()
    # Closed at one replica, stored: the other learns it at its next batching round.
    assert second.intake.closed_upto == {"homepage": clock.epoch}
    barrier, done = threading.Barrier(2), []

    def evaluate(service: object) -> None:
        barrier.wait()
        done.append(service.run_batching())  # type: ignore[attr-defined]

    threads = [threading.Thread(target=evaluate, args=(s,)) for s in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(done) == [0, 1]
    with first.store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(tables.groups)).scalar() == 1
    ledger = second.ledger()
    assert ledger["pending"] == ledger["held"] == ledger["purged"] == 0
    assert ledger["in_batches_unforwarded"] + ledger["deleted_by_algorithm_3"] == 40


def test_sqlite_refuses_replicas(tmp_path: Path) -> None:
    result = CliRunner().invoke(up_command, ["--var", str(tmp_path), "--replicas", "2"])
    assert result.exit_code != 0
    assert "need PostgreSQL" in result.output and "--database-url-template" in result.output


@dataclass
class Tally:
    """Per shuffler: contributions that landed (a 202, or a retry told the nonce was used:
    its first attempt landed unanswered), and any answer that is neither."""

    landed: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def land(self, shuffler: str) -> None:
        with self.lock:
            self.landed[shuffler] = self.landed.get(shuffler, 0) + 1


@pytest.fixture
def deployment(tmp_path: Path, postgres_template: str) -> Iterator[dict[str, launcher.Service]]:
    overrides = {
        **TEST_SHUFFLER_SETTINGS,
        "ESA_SHUFFLER_PART_FRAGMENTS": str(PART_FRAGMENTS),
        "ESA_SHUFFLER_ENROLL_PER_MINUTE": "600000",
        # A killed forwarder's leases run out quickly, so the other replica takes its parts.
        "ESA_SHUFFLER_FORWARD_LEASE_SECONDS": "3",
        "ESA_ANALYZER_OPENING_PROCESSES": "1",
        "ESA_ANALYZER_OPENING_POLL_SECONDS": "0.1",
    }
    services = launcher.up(
        tmp_path,
        SHUFFLERS,
        launcher.free_base_port(launcher.scaled_ports(SHUFFLERS, REPLICAS, WORKERS)),
        timeout=90,
        database_template=postgres_template,
        replicas=REPLICAS,
        workers=WORKERS,
        channels=[CHANNEL],
        overrides=overrides,
    )
    try:
        yield {service.name: service for service in services}
    finally:
        launcher.stop(services)


def _sealed_pool(analyzer_url: str, size: int) -> FreshReports:
    """``size`` k-RAPPOR reports, sealed afresh for each contribution that takes one."""
    # Bound to the one epoch the test reports in (10^8-second epochs) and the default crowd.
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    return FreshReports.of(analyzer_url, CHANNEL, epoch, [i % 20 for i in range(size)])


def _public_key(url: str) -> X25519PublicKey:
    config = httpx.get(url + "/v1/config", timeout=30).json()
    return load_x25519_public(base64.b64decode(config["public_key"]))


def _post(client: httpx.Client, path: str, **kwargs: object) -> httpx.Response | None:
    """POST, retried while HAProxy or a dying replica cannot answer; None if it never did."""
    for _ in range(40):
        try:
            answer = client.post(path, **kwargs)  # type: ignore[arg-type]
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        if answer.status_code not in RETRIED:
            return answer
        time.sleep(0.1)
    return None


def _contribute(
    client: httpx.Client,
    sid: str,
    pool: FreshReports,
    key: X25519PublicKey,
    tally: Tally,
) -> None:
    """One fresh client's contribution, the same sealed bytes (nonce) on every retry."""
    enrolled = _post(client, "/v1/enroll")
    if enrolled is None or enrolled.status_code != 200:
        tally.unexpected.append(f"{sid} enroll {enrolled and enrolled.text}")
        return
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    fragments = pool[random.randrange(len(pool))]
    blob = seal_contribution(
        Contribution(
            channel_id=CHANNEL.id, crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=fragments
        ),
        sid,
        key,
    )
    headers = {
        "Authorization": f"Bearer {enrolled.json()['client_token']}",
        "Content-Type": "application/octet-stream",
    }
    answer = _post(client, "/v1/contributions", content=blob, headers=headers)
    if answer is not None and (
        answer.status_code == 202 or answer.json().get("error") == "replayed_nonce"
    ):
        tally.land(sid)
    else:
        tally.unexpected.append(f"{sid} contribute {answer and answer.text}")


def _send(url: str, sid: str, pool: FreshReports, stop: threading.Event, tally: Tally) -> None:
    key = _public_key(url)
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            _contribute(client, sid, pool, key, tally)


def _count(engine: Engine, query: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one() or 0)  # type: ignore[call-overload]


def _delivering(engine: Engine) -> bool:
    """Delivery has begun: a part of the released batch was acknowledged (usually others still
    wait; on a slow poll all may be in, and conservation must hold either way)."""
    p = tables.batch_parts.c
    return _count(engine, select(func.count()).where(p.status == "forwarded")) > 0


def _settled(shufflers: dict[str, Engine], analyzer: Engine) -> bool:
    p, a = tables.batch_parts.c, analyzer_tables.batch_parts.c
    undelivered = sum(
        _count(e, select(func.count()).where(p.status.not_in(["forwarded", "staged"])))
        for e in shufflers.values()
    )
    waiting = _count(analyzer, select(func.count()).where(a.status != "opened"))
    open_groups = sum(len(make_store(e).open_groups()) for e in shufflers.values())
    return undelivered == waiting == open_groups == 0


def _analyzer_received(engine: Engine) -> dict[str, int]:
    """Contributions in complete batches per shuffler, after checking that every part was
    opened once and every fragment accumulated once."""
    t = analyzer_tables
    runtime = ChannelRuntime.build(CHANNEL, [f"shuffler-{i}" for i in range(1, SHUFFLERS + 1)])
    with engine.connect() as conn:
        parts = conn.execute(select(t.batch_parts)).all()
        receipts = conn.execute(select(t.receipts)).all()
        accumulators = conn.execute(select(t.accumulators)).all()
        open_batches = conn.execute(select(func.count()).select_from(t.open_batches)).scalar()
    assert {p.status for p in parts} == {"opened"} and open_batches == 0
    assert len(receipts) == len({p.batch_id for p in parts})
    for receipt in receipts:
        mine = [p for p in parts if p.batch_id == receipt.batch_id]
        assert sorted(p.part for p in mine) == list(range(mine[0].parts))
        assert receipt.n_fragments == sum(p.n_fragments for p in mine) and receipt.invalid == 0
    for accumulator in accumulators:
        theirs = [r for r in receipts if r.shuffler_id == accumulator.shuffler_id]
        assert accumulator.batches == len(theirs) == 1  # each group evaluated and counted once
        counts = runtime.mechanism.load_accumulator(bytes(accumulator.state)).counts  # type: ignore[attr-defined]
        assert int(counts.sum()) == sum(r.n_fragments for r in theirs)
    return {r.shuffler_id: int(r.n_contributions) for r in receipts}


def test_replicas_and_workers_behind_haproxy_lose_nothing_and_count_nothing_twice(
    deployment: dict[str, launcher.Service], postgres_template: str, tmp_path: Path
) -> None:
    names = [f"shuffler-{i}" for i in range(1, SHUFFLERS + 1)]
    fronts = {sid: deployment[f"haproxy:{sid}"].url for sid in names}
    pool = _sealed_pool(deployment["haproxy:analyzer"].url, 100)
    tally, stop = Tally(), threading.Event()
    senders = [
        threading.Thread(target=_send, args=(fronts[sid], sid, pool, stop, tally)) for sid in names
    ]
    for sender in senders:
        sender.start()
    time.sleep(INGEST_SECONDS / 2)
    deployment["shuffler-1.r1"].kill()  # during ingest
    at_kill = dict(tally.landed)
    time.sleep(INGEST_SECONDS / 2)
    # The trust domain goes on taking contributions on its other replica.
    wait_until(lambda: tally.landed.get("shuffler-1", 0) >= at_kill.get("shuffler-1", 0) + 10, 30)
    wait_until(lambda: all(tally.landed.get(sid, 0) >= LANDED for sid in names), 30)
    stop.set()
    for sender in senders:
        sender.join()
    assert not tally.unexpected, tally.unexpected[:5]
    assert all(tally.landed.get(sid, 0) >= LANDED for sid in names), tally.landed

    epoch = int(time.time() // CHANNEL.epoch_seconds)
    urls = {s: postgres_template.replace("{service}", s) for s in ("analyzer", "shuffler_2")}
    engines = {
        sid: db.make_engine(postgres_template.replace("{service}", sid.replace("-", "_")))
        for sid in names
    }
    analyzer = db.make_engine(urls["analyzer"])
    try:
        closing = [
            threading.Thread(
                target=_post,
                args=(httpx.Client(base_url=fronts[sid], timeout=60), "/v1/admin/close"),
                kwargs={
                    "json": {"channel_id": CHANNEL.id, "epoch": epoch},
                    "headers": own_headers(tmp_path, sid),  # each trust domain's own token
                },
            )
            for sid in names
        ]
        for thread in closing:
            thread.start()
        wait_until(lambda: _delivering(engines["shuffler-2"]), timeout=30, interval=0.02)
        deployment["shuffler-2.r1"].kill()  # during delivery
        deployment["analyzer.w1"].kill()
        for thread in closing:
            thread.join()
        # The close reached every live replica: each refuses the closed epoch now.
        for sid in names:
            for replica in (1, 2):
                service = deployment[f"{sid}.r{replica}"]
                if service.process.poll() is None:
                    wait_until(lambda s=service, i=sid: _refuses(s.url, i, epoch, pool), 10)
        wait_until(lambda: _settled(engines, analyzer), timeout=60, interval=0.2)
        received = _analyzer_received(analyzer)
        for sid, engine in engines.items():
            ledger = make_store(engine).ledger()
            assert ledger["pending"] == ledger["held"] == ledger["purged"] == 0, (sid, ledger)
            assert ledger["in_batches_unforwarded"] == 0, (sid, ledger)
            # 0 lost: every contribution that landed is delivered or deleted by Algorithm 3.
            assert (
                ledger["in_batches_forwarded"] + ledger["deleted_by_algorithm_3"]
                == (tally.landed[sid])
            ), (sid, ledger, tally.landed)
            # 0 counted twice: the analyzer counts exactly what the shuffler released.
            assert received.get(sid, 0) == ledger["in_batches_forwarded"], (sid, received)
            groups = _count(engine, select(func.count()).select_from(tables.groups))
            assert groups == 1, (sid, groups)
    finally:
        for engine in [*engines.values(), analyzer]:
            engine.dispose()


def _refuses(url: str, sid: str, epoch: int, pool: FreshReports) -> bool:
    """The replica at ``url`` refuses a fresh client's contribution to ``epoch``."""
    with httpx.Client(base_url=url, timeout=30) as client:
        token = client.post("/v1/enroll").json()["client_token"]
        blob = seal_contribution(
            Contribution(
                channel_id=CHANNEL.id,
                crowd_id="",
                epoch=epoch,
                nonce=new_nonce(),
                fragments=pool[0],
            ),
            sid,
            _public_key(url),
        )
        answer = client.post(
            "/v1/contributions",
            content=blob,
            headers={"Authorization": f"Bearer {token}", "Content-Type": OCTETS},
        )
    return answer.status_code != 202 and answer.json().get("error") == "epoch_not_open"


def test_analyzer_workers_open_a_stored_part_once(postgres_url: str) -> None:
    """Two analyzer workers (two stores, two engines) on one PostgreSQL: a part another
    worker is opening (it holds the part's advisory lock) is skipped, and opened once after."""

    from ..analyzer.helpers import VALUES, build, make_batch

    first, second = build(postgres_url), build(postgres_url)
    first.intake.accept(*make_batch(VALUES[:50]))  # body, signature, sending shuffler
    (header,) = first.store.pending_parts()
    key = {"k": runtime_db.lock_key(["analyzer-part", header.batch_id, header.part])}
    with first.store.engine.connect() as held:
        held.execute(text("SELECT pg_advisory_lock(:k)"), key)
        assert second.opener.open_pending() == 0
        assert second.store.unopened_parts() == 1
        held.execute(text("SELECT pg_advisory_unlock(:k)"), key)
        held.commit()
    assert second.opener.open_pending() == 1 and first.opener.open_pending() == 0
    assert (
        second.store.unopened_parts() == 0
        and len(first.store.incomplete(CHANNEL.id, "", 0, 99)) == 0
    )
    for layers in (first, second):
        layers.opener.stop()
        layers.store.engine.dispose()
