"""The contribution store on both dialects: group commit with conflicts sorted out, revocations
and closed epochs that survive a restart, forwarding state, retention, the ledger."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import create_engine

from common.envelope import new_nonce
from shuffler.errors import QuotaExceededError, ReplayedNonceError
from shuffler.records import Conflict
from shuffler.store import (
    PostgresContributionStore,
    SqliteContributionStore,
    make_store,
    new_receipts,
)

from .factory import contribute, fill, make_service, pending


def test_one_implementation_per_dialect(tmp_path: Path) -> None:
    assert isinstance(
        make_store(create_engine(f"sqlite:///{tmp_path / 'a.db'}")), SqliteContributionStore
    )
    engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert isinstance(make_store(engine), PostgresContributionStore)
    with pytest.raises(ValueError, match="unsupported database"):
        make_store(SimpleNamespace(dialect=SimpleNamespace(name="mysql")))  # type: ignore[arg-type]


def test_receipts_are_unique_and_unguessable() -> None:
    receipts = new_receipts(1_000)
    assert len(set(receipts)) == 1_000 and all(len(r) == 32 for r in receipts)


def test_quota_and_replay(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path)
    token, nonce = service.tokens.issue(), new_nonce()
    assert contribute(service, token, clock.epoch, nonce=nonce).receipt
    again = contribute(service, token, clock.epoch)
    assert isinstance(again.refusal, QuotaExceededError) and again.receipt is None
    replay = contribute(service, service.tokens.issue(), clock.epoch, nonce=nonce)
    assert isinstance(replay.refusal, ReplayedNonceError)


def test_group_commit_sorts_out_conflicts_inside_one_batch(
    database_url: str, tmp_path: Path
) -> None:
    """One transaction, many rows (the HTTP writer's group commit): a fresh row lands, a row
    reusing its nonce is a replay and a second row of the same client is over quota, even
    when they conflict with each other rather than with rows already stored."""
    service, clock = make_service(database_url, tmp_path)
    epoch = clock.epoch
    first, other, fresh = service.tokens.issue(), service.tokens.issue(), service.tokens.issue()
    nonce = new_nonce()
    landings = service.store.insert(
        [
            pending(service, first, epoch, nonce=nonce),
            pending(service, other, epoch, nonce=nonce),
            pending(service, first, epoch),
            pending(service, fresh, epoch),
        ]
    )
    assert isinstance(landings[0], str) and isinstance(landings[3], str)
    assert landings[0] != landings[3]
    assert landings[1:3] == [Conflict.REPLAYED_NONCE, Conflict.OVER_QUOTA]
    assert service.ledger()["pending"] == 2
    everyone_new = service.commit(
        [pending(service, service.tokens.issue(), epoch) for _ in range(150)]
    )
    receipts = [s.receipt for s in everyone_new]
    assert all(receipts) and len(set(receipts)) == 150 and service.ledger()["pending"] == 152


def test_revocations_and_closed_epochs_survive_a_restart(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path)
    token = service.tokens.issue()
    service.revoke(token.split(".")[0])
    service.revoke(token.split(".")[0])  # idempotent
    service.close("homepage", clock.epoch - 1)
    service.close("homepage", clock.epoch - 1)
    fresh, _ = make_service(database_url, tmp_path)
    fresh.load_state()
    assert fresh.store.revoked() == {token.split(".")[0]}
    assert fresh.intake.closed_upto == {"homepage": clock.epoch - 1}


def test_forwarding_state_and_retention(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path, retention_seconds=7200.0)
    fill(service, clock.epoch, 60)
    service.close("homepage", clock.epoch)
    due = service.store.due_parts(clock.now)
    claimed = service.store.claim(due[0], clock.now, 60.0)
    assert len(due) == 1 and claimed is not None and claimed.attempts == 0
    service.store.record_retry(due[0], 1, clock.now + 10, "HTTP 503")
    assert service.store.due_parts(clock.now) == []
    again = service.store.claim(service.store.due_parts(clock.now + 10)[0], clock.now + 10, 60.0)
    assert again is not None and again.attempts == 1
    kept = service.ledger()["in_batches_unforwarded"]
    clock.now += 7201
    assert service.purge() == kept
    ledger = service.ledger()
    assert ledger["in_batches_unforwarded"] == 0 and ledger["purged"] == kept
    assert service.events.get("deleted_by_retention") == kept
