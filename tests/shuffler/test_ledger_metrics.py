"""The shuffler's trust-domain gauges (``esa_shuffler_ledger_contributions{state}`` and
``esa_shuffler_ledger_deleted{cause}``, :class:`shuffler.metrics.ShufflerCollector`) on a real
SQLite store: released, aborted and held groups (a seeded Algorithm 3), a batch with a part
the analyzer refused, a retention purge (cause ``refused`` for that batch) and contributions
still pending. The states add up to every acknowledged contribution, the
deletions by cause add up to the ledger's deletions and, in one process, equal the process's
own counters (the independent record of the same events); the existing metrics stay."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import select

from common.randomness import SeededSource
from common.wire import ChannelPolicy
from services.tools.loadtest import verify
from shuffler import tables
from shuffler.metrics import ShufflerCollector
from shuffler.records import PartKey
from shuffler.service import ShufflerService

from .factory import EPOCH_SECONDS, fill, make_service

#: Scale 1 and shift ln 4 ≈ 1.39: a group aborts with probability 1/8, so SEED's draws give
#: the three outcomes over :data:`SIZES` (asserted, not assumed).
POLICY = ChannelPolicy(
    id="homepage",
    epoch_seconds=EPOCH_SECONDS,
    min_crowd=5,
    eps_cr=2.0,
    delta_cr=0.5,
    max_fragments=8,
)
SEED = 0
#: One group per epoch: released, aborted, released, held (3 < min_crowd).
SIZES = (30, 30, 30, 3)
PENDING = 7
STATES = {
    "pending",
    "held",
    "in_batches_forwarded",
    "in_batches_unforwarded",
    "in_batches_refused",
    "deleted_by_algorithm_3",
    "purged",
}


def _registry(service: ShufflerService) -> CollectorRegistry:
    """The collector wired as ``shuffler.app`` wires it."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ShufflerCollector(service.events, service.store.ledger_by_cause))
    return registry


def _family(registry: CollectorRegistry, name: str, label: str) -> dict[str, float]:
    return {
        sample.labels[label]: sample.value
        for family in registry.collect()
        if family.name == name
        for sample in family.samples
    }


def test_ledger_gauges_account_for_every_contribution_by_state_and_cause(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'shuffler.db'}"
    service, clock = make_service(
        url, tmp_path, rng=SeededSource(SEED), policy=POLICY, retention_seconds=10 * 3600.0
    )
    registry = _registry(service)
    empty = _family(registry, "esa_shuffler_ledger_contributions", "state")
    assert empty == dict.fromkeys(STATES, 0.0)
    for size in SIZES:
        fill(service, clock.epoch, size)
        clock.now = (clock.epoch + 1) * EPOCH_SECONDS + 10
        assert service.run_batching() == 1
    with service.store.engine.connect() as conn:
        statuses = conn.execute(select(tables.groups.c.status)).scalars().all()
    assert sorted(statuses) == ["aborted", "held", "released", "released"]
    evaluated = _family(registry, "esa_shuffler_ledger_contributions", "state")
    assert evaluated["held"] == SIZES[-1] and evaluated["pending"] == 0
    batched = evaluated["in_batches_unforwarded"]  # never forwarded: no analyzer here
    assert batched > 0 and evaluated["in_batches_refused"] == 0
    # The analyzer refuses a part of one batch for good (what the forwarder records on a 422).
    with service.store.engine.connect() as conn:
        first = conn.execute(
            select(tables.batches.c.batch_id, tables.batches.c.n_contributions)
            .order_by(tables.batches.c.created_at)
            .limit(1)
        ).one()
    service.store.record_failed(PartKey(first[0], 0), "HTTP 422: duplicate_group")
    refused = int(first[1])
    split = _family(registry, "esa_shuffler_ledger_contributions", "state")
    assert split["in_batches_refused"] == refused > 0
    assert split["in_batches_unforwarded"] == batched - refused > 0
    clock.now += 10 * 3600.0  # past retention: the held group and the batches are purged
    assert service.purge() == SIZES[-1] + batched
    fill(service, clock.epoch, PENDING)  # the current epoch, still open

    states = _family(registry, "esa_shuffler_ledger_contributions", "state")
    deleted = _family(registry, "esa_shuffler_ledger_deleted", "cause")
    ledger = service.ledger()
    assert set(states) == STATES == set(ledger) and states == ledger
    assert sum(states.values()) == sum(SIZES) + PENDING  # every acknowledged contribution
    assert states["pending"] == PENDING and states["held"] == 0
    assert states["purged"] == SIZES[-1] + batched and states["in_batches_unforwarded"] == 0
    assert states["in_batches_refused"] == 0
    assert set(deleted) == {"randomized_deletion", "abort", "retention", "refused", "late"}
    assert deleted["abort"] == 30 and deleted["late"] == 0
    assert deleted["retention"] == SIZES[-1] + batched - refused
    assert deleted["refused"] == refused
    assert 0 < deleted["randomized_deletion"] < 30
    assert sum(deleted.values()) == ledger["deleted_by_algorithm_3"] + ledger["purged"]
    # One process: the database's deletions are exactly what this process counted.
    counted = _family(registry, "esa_shuffler_contributions_deleted", "cause")
    assert counted == {
        c: deleted[c] for c in ("randomized_deletion", "abort", "retention", "refused")
    }
    depth = _family(registry, "esa_shuffler_queue_depth", "state")
    queues = ("pending", "held", "in_batches_unforwarded", "in_batches_refused")
    assert depth == {s: states[s] for s in queues}


def test_verify_reads_the_gauges_and_refuses_a_shuffler_without_them(tmp_path: Path) -> None:
    """What ``esa loadtest`` verification reads from a scrape: acknowledged = the sum of the
    ledger's states and deletions by cause; a shuffler without the ledger gauges (older than
    them) is refused, named, rather than read from its process's counters."""
    service, clock = make_service(
        f"sqlite:///{tmp_path / 'shuffler.db'}", tmp_path, rng=SeededSource(SEED), policy=POLICY
    )
    registry = _registry(service)
    before = verify.parse_metrics(generate_latest(registry).decode())
    fill(service, clock.epoch, 30)
    service.events.count("contributions_received", 30)  # what the ingest route counts
    clock.now = (clock.epoch + 1) * EPOCH_SECONDS + 10
    assert service.run_batching() == 1
    after = verify.parse_metrics(generate_latest(registry).decode())
    kept = service.ledger()["in_batches_unforwarded"]
    state = verify.domain_state(after, "http://s")
    assert state == {
        "received": 30,
        "deleted_randomized_deletion": 30 - kept,
        "deleted_abort": 0,
        "deleted_retention": 0,
        "deleted_refused": 0,
        "deleted_late": 0,
    }
    queues = {"held": 0.0, "pending": 0.0}
    start = verify.domain_state(before, "http://s") | queues
    check = verify.conservation({"s": start}, {"s": state | queues}, 30, kept)
    assert check["lost"] == 0 and check["shufflers_acknowledged"] == 30
    assert verify.conservation_problems(check) == []
    old = {k: v for k, v in after.items() if not k.startswith("esa_shuffler_ledger_")}
    assert old["esa_shuffler_contributions_received_total"] == 30  # the counters are there
    too_old = r"http://s/metrics has no ledger gauges .*shuffler too old"
    with pytest.raises(verify.VerifyError, match=too_old):
        verify.domain_state(old, "http://s")


def test_the_ledger_is_read_in_one_snapshot(database_url: str, tmp_path: Path) -> None:
    """A change committed while the ledger is being read (here a purge, between the first read
    and the last) is not seen by the reads after it: on PostgreSQL read committed would give
    every statement its own snapshot, and a batch forwarded between two of the ledger's reads
    was counted in neither (a reviewer's reproduction)."""
    service, _ = make_service(database_url, tmp_path, policy=POLICY)
    p = tables.purges
    count = select(p.c.contributions).select_from(p)
    with service.store._snapshot() as reading:
        assert reading.execute(count).all() == []  # the snapshot starts at this read
        with service.store.engine.begin() as writing:
            writing.execute(p.insert().values(reason="retention", contributions=5, purged_at=1.0))
        assert reading.execute(count).all() == []
    ledger, causes = service.store.ledger_by_cause()
    assert ledger["purged"] == causes["retention"] == 5
