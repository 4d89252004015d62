"""Shuffler core over both storage backends: intake, quota, replay, Algorithm 3, batches,
retention, revocation, and the ledger that accounts for every acknowledged contribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from sqlalchemy import select

from common.envelope import Contribution, KeyRing, new_nonce, seal_contribution, verify
from common.wire import Batch, ChannelPolicy
from services.runtime import db
from shuffler import storage
from shuffler.app import MIGRATIONS
from shuffler.core import Pending, RejectedError, ShufflerCore
from shuffler.settings import ShufflerSettings

EPOCH_SECONDS = 3600
POLICY = ChannelPolicy(
    id="homepage",
    epoch_seconds=EPOCH_SECONDS,
    min_crowd=5,
    eps_cr=1.0,
    delta_cr=1e-3,
    max_fragments=8,
    max_batch=1000,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * EPOCH_SECONDS + 100.0

    def __call__(self) -> float:
        return self.now


def make_core(url: str, tmp_path: Path, **overrides: object) -> tuple[ShufflerCore, Clock]:
    settings = ShufflerSettings(
        database_url=url, key_dir=tmp_path / "keys", channels=[POLICY], **overrides
    )  # type: ignore[arg-type]
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    clock = Clock()
    core = ShufflerCore(
        settings,
        engine,
        KeyRing.of(X25519PrivateKey.generate()),
        Ed25519PrivateKey.generate(),
        clock,
    )
    return core, clock


def contribute(
    core: ShufflerCore,
    token: str,
    epoch: int,
    fragments: int = 2,
    channel: str = "homepage",
    nonce: bytes | None = None,
) -> object:
    contribution = Contribution(
        channel,
        "",
        epoch,
        nonce or new_nonce(),
        tuple(bytes([i % 256]) * 72 for i in range(fragments)),
    )
    blob = seal_contribution(contribution, core.settings.shuffler_id, core.ring.public())
    pending = core.validate(token, blob)
    return core.store([pending])[0]


def test_quota_replay_and_validation(database_url: str, tmp_path: Path) -> None:
    core, clock = make_core(database_url, tmp_path)
    epoch = int(clock.now // EPOCH_SECONDS)
    token = core.tokens.issue()
    nonce = new_nonce()
    assert contribute(core, token, epoch, nonce=nonce).receipt  # type: ignore[attr-defined]
    again = contribute(core, token, epoch)
    assert again.rejection.error == "quota_exceeded"  # type: ignore[attr-defined]
    replay = contribute(core, core.tokens.issue(), epoch, nonce=nonce)
    assert replay.rejection.error == "replayed_nonce"  # type: ignore[attr-defined]
    with pytest.raises(RejectedError) as raised:
        contribute(core, core.tokens.issue(), epoch - 5)
    assert raised.value.status == 400 and raised.value.error == "epoch_not_open"
    with pytest.raises(RejectedError) as raised:
        contribute(core, core.tokens.issue(), epoch, fragments=9)
    assert raised.value.status == 413
    with pytest.raises(RejectedError) as raised:
        contribute(core, core.tokens.issue(), epoch, channel="unknown")
    assert raised.value.error == "unknown_channel"
    with pytest.raises(RejectedError) as raised:
        contribute(core, token.split(".")[0] + ".forged", epoch)
    assert raised.value.status == 401


def test_group_commit_sorts_out_conflicts_inside_one_batch(
    database_url: str, tmp_path: Path
) -> None:
    """One transaction, many rows (the HTTP writer's group commit): a fresh row lands, a row
    reusing its nonce is a replay and a second row of the same client is over quota, even
    when they conflict with each other rather than with rows already stored."""

    def pending(token: str, nonce: bytes) -> Pending:
        contribution = Contribution("homepage", "", epoch, nonce, (bytes(72),) * 2)
        blob = seal_contribution(contribution, core.settings.shuffler_id, core.ring.public())
        return core.validate(token, blob)

    core, clock = make_core(database_url, tmp_path)
    epoch = int(clock.now // EPOCH_SECONDS)
    first, other, fresh = core.tokens.issue(), core.tokens.issue(), core.tokens.issue()
    nonce = new_nonce()
    batch = [
        pending(first, nonce),
        pending(other, nonce),
        pending(first, new_nonce()),
        pending(fresh, new_nonce()),
    ]
    stored = core.store(batch)
    assert stored[0].receipt and stored[3].receipt and stored[0].receipt != stored[3].receipt
    assert stored[1].rejection is not None and stored[1].rejection.error == "replayed_nonce"
    assert stored[2].rejection is not None and stored[2].rejection.error == "quota_exceeded"
    assert core.ledger()["pending"] == 2
    everyone_new = core.store([pending(core.tokens.issue(), new_nonce()) for _ in range(150)])
    receipts = [s.receipt for s in everyone_new]
    assert all(receipts) and len(set(receipts)) == 150 and core.ledger()["pending"] == 152


def test_revocation_is_persistent(database_url: str, tmp_path: Path) -> None:
    core, _ = make_core(database_url, tmp_path)
    token = core.tokens.issue()
    core.revoke(token.split(".")[0])
    with pytest.raises(RejectedError, match="revoked"):
        core.tokens.verify(token)
    fresh, _ = make_core(database_url, tmp_path)
    fresh.load_state()
    with pytest.raises(RejectedError, match="revoked"):
        fresh.tokens.verify(token)


def test_epoch_close_releases_one_signed_batch_and_accounts_for_everyone(
    database_url: str, tmp_path: Path
) -> None:
    core, clock = make_core(database_url, tmp_path)
    epoch = int(clock.now // EPOCH_SECONDS)
    for _ in range(60):
        assert contribute(core, core.tokens.issue(), epoch).receipt  # type: ignore[attr-defined]
    assert core.run_batching() == 0  # epoch still open
    clock.now = (epoch + 1) * EPOCH_SECONDS + 10
    assert core.run_batching() == 1
    assert core.run_batching() == 0  # never evaluated twice
    with core.engine.connect() as conn:
        group = conn.execute(select(storage.groups)).one()
        body, signature = conn.execute(
            select(storage.batches.c.body, storage.batches.c.signature)
        ).one()
    batch = Batch.model_validate_json(body)
    assert group.status == "released" and batch.n_contributions == group.kept
    assert len(batch.fragments) == 2 * group.kept
    import base64

    assert verify(body, base64.b64decode(signature), core.signing_key.public_key())
    ledger = core.ledger()
    assert ledger["in_batches_unforwarded"] + ledger["deleted_by_algorithm_3"] == 60
    assert ledger["pending"] == 0


def test_small_groups_are_held_then_purged(database_url: str, tmp_path: Path) -> None:
    core, clock = make_core(database_url, tmp_path, retention_seconds=7200.0)
    epoch = int(clock.now // EPOCH_SECONDS)
    for _ in range(8):
        contribute(core, core.tokens.issue(), epoch)
    clock.now = (epoch + 1) * EPOCH_SECONDS + 10
    core.run_batching()
    ledger = core.ledger()
    with core.engine.connect() as conn:
        status = conn.execute(select(storage.groups.c.status)).scalar_one()
    assert status in ("held", "aborted")
    assert ledger["in_batches_unforwarded"] == 0
    clock.now += 7200
    core.purge()
    ledger = core.ledger()
    assert ledger["held"] == 0 and ledger["purged"] + ledger["deleted_by_algorithm_3"] == 8


def test_batch_contains_no_identifiers(database_url: str, tmp_path: Path) -> None:
    core, clock = make_core(database_url, tmp_path)
    epoch = int(clock.now // EPOCH_SECONDS)
    tokens, nonces = [], []
    for _ in range(80):
        token, nonce = core.tokens.issue(), new_nonce()
        tokens.append(token)
        nonces.append(nonce)
        contribute(core, token, epoch, nonce=nonce)
    with core.engine.connect() as conn:
        received = conn.execute(select(storage.contributions.c.received_at)).scalars().all()
    clock.now = (epoch + 1) * EPOCH_SECONDS + 10
    core.run_batching()
    with core.engine.connect() as conn:
        body = conn.execute(select(storage.batches.c.body)).scalar_one()
    assert set(json.loads(body)) == {
        "batch_id",
        "shuffler_id",
        "channel_id",
        "crowd_id",
        "epoch",
        "n_contributions",
        "fragments",
    }
    import base64

    for token, nonce in zip(tokens, nonces, strict=True):
        client_id = token.split(".")[0]
        for needle in (
            client_id.encode(),
            token.encode(),
            nonce,
            nonce.hex().encode(),
            base64.b64encode(nonce),
        ):
            assert needle not in body
    for stamp in received:
        assert str(stamp).encode() not in body and str(int(stamp)).encode() not in body


def test_overlapping_batching_runs_release_each_group_once(
    database_url: str, tmp_path: Path
) -> None:
    """The periodic batcher and an admin close may run at once: one release, no error."""
    import threading

    core, clock = make_core(database_url, tmp_path)
    epoch = int(clock.now // EPOCH_SECONDS)
    for _ in range(60):
        contribute(core, core.tokens.issue(), epoch)
    clock.now = (epoch + 1) * EPOCH_SECONDS + 10
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(core.run_batching())) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 0, 0, 1]
    with core.engine.connect() as conn:
        assert conn.execute(select(storage.groups)).all().__len__() == 1


def test_commit_queue_answers_503_when_the_commit_fails(tmp_path: Path) -> None:
    """A failed group commit stores nothing and answers every request of the batch (no hang)."""
    import asyncio

    from sqlalchemy.exc import OperationalError

    from shuffler.app import CommitQueue

    core, clock = make_core(f"sqlite:///{tmp_path / 'test.db'}", tmp_path)
    epoch = int(clock.now // EPOCH_SECONDS)

    def pending() -> Pending:
        contribution = Contribution("homepage", "", epoch, new_nonce(), (bytes(72),) * 2)
        blob = seal_contribution(contribution, core.settings.shuffler_id, core.ring.public())
        return core.validate(core.tokens.issue(), blob)

    def broken(_: object) -> object:
        raise OperationalError("INSERT", {}, Exception("database is locked"))

    async def run() -> list[object]:
        queue = CommitQueue(core, max_batch=8)
        queue.start()
        try:
            good = await queue.submit(pending())
            core.store = broken  # type: ignore[assignment,method-assign]
            bad = await asyncio.gather(*(queue.submit(pending()) for _ in range(5)))
            return [good, *bad]
        finally:
            await asyncio.to_thread(queue.stop)

    good, *bad = asyncio.run(run())
    assert good.receipt  # type: ignore[attr-defined]
    for stored in bad:
        assert stored.rejection.status == 503  # type: ignore[attr-defined]
        assert stored.rejection.error == "storage_unavailable"  # type: ignore[attr-defined]
