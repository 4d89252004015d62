"""Issue 12: crowds come from the channel's declared set, and the quota is one contribution per
(client, channel, epoch) whatever crowd a contribution names — on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic import command
from pydantic import ValidationError
from sqlalchemy import inspect, select, text

from common.envelope import Contribution, new_nonce, seal_contribution
from common.wire import MAX_CROWDS, ChannelConfig, ChannelPolicy
from runtime import db
from shuffler import tables
from shuffler.errors import QuotaExceededError, UnknownCrowdError
from shuffler.records import Conflict, GroupKey, Pending
from shuffler.service import ShufflerService

from .factory import POLICY, make_service, migrations_on

CROWDS = ("", "eu", "us-west.1")


def _policy(**changes: Any) -> ChannelPolicy:
    return ChannelPolicy(**{**POLICY.model_dump(), "crowds": CROWDS, **changes})


def _pending(service: ShufflerService, token: str, epoch: int, crowd: str) -> Pending:
    contribution = Contribution(
        channel_id="homepage",
        crowd_id=crowd,
        epoch=epoch,
        nonce=new_nonce(),
        fragments=(bytes(72),),
    )
    blob = seal_contribution(contribution, service.settings.shuffler_id, service.ring.public())
    return service.validate(service.admit(token), blob)


def test_declared_crowds_are_validated_and_default_to_one_unnamed_crowd() -> None:
    assert ChannelPolicy(id="c").crowds == ("",)
    assert _policy().crowds == CROWDS
    config = ChannelConfig(id="c", mechanism="krr", params={"k": 2, "eps": 1.0}, crowds=["eu"])
    assert config.policy().crowds == ("eu",)  # what shufflers enforce, from the signed config
    assert config.model_dump(mode="json")["crowds"] == ["eu"]
    bad: list[object] = [
        [],
        ["eu", "eu"],
        ["EU"],
        ["eu\n"],
        ["-eu"],
        ["a b"],
        ["é"],
        ["x" * 65],
        [str(i) for i in range(MAX_CROWDS + 1)],
        "eu",
    ]
    for crowds in bad:
        with pytest.raises(ValidationError):
            ChannelPolicy(id="c", crowds=crowds)
    assert len(ChannelPolicy(id="c", crowds=[str(i) for i in range(MAX_CROWDS)]).crowds) == 64


def test_a_crowd_the_channel_does_not_declare_is_refused(database_url: str, tmp_path: Path) -> None:
    service, clock = make_service(database_url, tmp_path, policy=_policy())
    for crowd in CROWDS:
        stored = service.commit([_pending(service, service.tokens.issue(), clock.epoch, crowd)])
        assert stored[0].receipt
    for crowd in ("asia", "EU", "eu ", "x" * 255):
        with pytest.raises(UnknownCrowdError) as raised:
            _pending(service, service.tokens.issue(), clock.epoch, crowd)
        assert raised.value.code == "unknown_crowd" and "homepage" in raised.value.detail
        assert len(raised.value.detail) < 200  # a 255-byte crowd is not echoed whole
    groups = sorted(key.crowd_id for key in service.store.open_groups())
    assert groups == sorted(CROWDS)  # Algorithm 3's groups stay per (channel, crowd, epoch)


def test_the_quota_is_per_channel_and_epoch_whatever_the_crowd(
    database_url: str, tmp_path: Path
) -> None:
    """The attack of issue 12: one token, one contribution per crowd → one 202, the rest 409."""
    service, clock = make_service(database_url, tmp_path, policy=_policy())
    token = service.tokens.issue()
    first = service.commit([_pending(service, token, clock.epoch, "eu")])[0]
    assert first.receipt
    for crowd in CROWDS:
        again = service.commit([_pending(service, token, clock.epoch, crowd)])[0]
        assert again.receipt is None and isinstance(again.refusal, QuotaExceededError)
        assert "(client, channel, epoch)" in again.refusal.detail
    # In one group commit too: the rows conflict with each other, not with stored ones.
    other = service.tokens.issue()
    landings = service.store.insert([_pending(service, other, clock.epoch, c) for c in CROWDS])
    assert isinstance(landings[0], str)
    assert landings[1:] == [Conflict.OVER_QUOTA, Conflict.OVER_QUOTA]
    assert service.ledger()["pending"] == 2
    clock.now += POLICY.epoch_seconds  # the next epoch is a new quota
    assert service.commit([_pending(service, token, clock.epoch, "us-west.1")])[0].receipt
    assert sorted(service.store.open_groups()) == sorted(
        [
            GroupKey("homepage", "eu", clock.epoch - 1),
            GroupKey("homepage", "", clock.epoch - 1),
            GroupKey("homepage", "us-west.1", clock.epoch),
        ]
    )
    assert service.ledger()["pending"] == 3


def test_migration_keeps_the_first_contribution_per_client_channel_epoch(
    database_url: str,
) -> None:
    """Contributions stored under the old quota (one per crowd): the first of each (client,
    channel, epoch) stays, the others are recorded as purged (nothing unaccounted for)."""
    engine = db.make_engine(database_url)
    rows = [("a", "", 1), ("a", "x", 1), ("a", "y", 1), ("a", "", 2), ("b", "x", 1)]
    with engine.begin() as conn:
        config = migrations_on(conn)
        command.upgrade(config, "0002")
        for i, (client, crowd, epoch) in enumerate(rows):
            conn.execute(
                text(
                    "INSERT INTO contributions (channel_id, crowd_id, epoch, client_id, nonce, "
                    "fragments, n_fragments, received_at, receipt) VALUES ('homepage', :crowd, "
                    ":epoch, :client, :nonce, :fragments, 1, 1.0, :receipt)"
                ),
                {
                    "crowd": crowd,
                    "epoch": epoch,
                    "client": client,
                    "nonce": bytes([i]) * 16,
                    "fragments": b"f",
                    "receipt": f"r{i}",
                },
            )
        command.upgrade(config, "0006")  # on SQLite 0007 drops the quota's index again
        c = tables.contributions.c
        kept = conn.execute(select(c.client_id, c.crowd_id, c.epoch).order_by(c.id)).all()
        purged = conn.execute(select(tables.purges.c.reason, tables.purges.c.contributions))
        purges = purged.all()
        quota = [
            u["column_names"]
            for u in inspect(conn).get_unique_constraints("contributions")
            if u["name"] == "uq_contribution_quota"
        ]
        command.upgrade(config, "head")
        command.downgrade(config, "0002")
        loose = [
            u["column_names"]
            for u in inspect(conn).get_unique_constraints("contributions")
            if u["name"] == "uq_contribution_quota"
        ]
    engine.dispose()
    assert [tuple(row) for row in kept] == [("a", "", 1), ("a", "", 2), ("b", "x", 1)]
    assert [tuple(row) for row in purges] == [("quota", 2)]
    assert [sorted(q) for q in quota] == [["channel_id", "client_id", "epoch"]]
    assert [sorted(q) for q in loose] == [["channel_id", "client_id", "crowd_id", "epoch"]]
