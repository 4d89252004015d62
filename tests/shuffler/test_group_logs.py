"""Issue 12: a group's size and its deletions are secret until released (randomized deletion's
ε_cr, ESA-revisited Theorem V.1), so the logs of a held or aborted group carry its status
only; a released group may log its batch's n_contributions, which the batch publishes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from common.randomness import SeededSource
from common.wire import ChannelPolicy
from runtime.logs import JsonFormatter
from shuffler.batcher import GroupStatus, randomized_deletion

from .factory import POLICY, fill, make_service

N = 12
#: Held needs kept < min_crowd; released needs kept >= min_crowd (N=12 minus ~4 deleted).
POLICIES = {
    GroupStatus.HELD: ChannelPolicy(**{**POLICY.model_dump(), "min_crowd": 11}),
    GroupStatus.ABORTED: ChannelPolicy(**{**POLICY.model_dump(), "min_crowd": 11}),
    GroupStatus.RELEASED: ChannelPolicy(**{**POLICY.model_dump(), "min_crowd": 2}),
}
#: Fields a log line may have besides the record's own (time, level, logger, message).
ALLOWED = {"channel", "epoch", "status"}


def _seed(status: GroupStatus, policy: ChannelPolicy) -> int:
    """The first seed whose first Laplace draw gives ``status`` for N contributions (the
    service's first draw is that group's noise), found deterministically."""
    return next(
        seed
        for seed in range(10_000)
        if randomized_deletion(N, policy, SeededSource(seed)).status is status
    )


@pytest.mark.parametrize("status", list(GroupStatus), ids=str)
def test_group_logs_carry_no_count_until_released(
    status: GroupStatus, database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = POLICIES[status]
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(_seed(status, policy)), policy=policy
    )
    fill(service, clock.epoch, N)
    caplog.set_level(logging.DEBUG, logger="esa.shuffler")
    assert service.close("homepage", clock.epoch) == 1
    assert service.events.get(f"group_{status}") == 1
    formatter = JsonFormatter()
    lines = [json.loads(formatter.format(r)) for r in caplog.records if r.name == "esa.shuffler"]
    evaluated = [line for line in lines if line["message"] == "group evaluated"]
    assert [line["status"] for line in evaluated] == [str(status)]
    for line in lines:
        extra = set(line) - {"time", "level", "logger", "message"}
        if status is GroupStatus.RELEASED:
            assert extra <= ALLOWED | {"n_contributions"}, line
        else:
            assert extra <= ALLOWED, line  # no n, kept, deleted, n_contributions
        assert not {"n", "kept", "deleted"} & extra, line
    if status is GroupStatus.RELEASED:
        released = service.ledger()["in_batches_unforwarded"]
        assert evaluated[0]["n_contributions"] == released < N


def test_retention_purge_of_a_held_group_logs_no_count(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone held group purged at retention expiry: the log says a purge happened, never how
    many (that number is the held group's size); the count stays on the credentialed ledger."""
    policy = POLICIES[GroupStatus.HELD]
    service, clock = make_service(
        database_url, tmp_path, rng=SeededSource(_seed(GroupStatus.HELD, policy)), policy=policy
    )
    fill(service, clock.epoch, N)
    assert service.close("homepage", clock.epoch) == 1
    clock.now += service.retention.retention_seconds + 1
    caplog.set_level(logging.DEBUG, logger="esa.shuffler")
    assert service.purge() == N
    formatter = JsonFormatter()
    lines = [json.loads(formatter.format(r)) for r in caplog.records if r.name == "esa.shuffler"]
    assert any("retention purge" in line["message"] for line in lines)
    for line in lines:
        assert str(N) not in line["message"], line
        assert set(line) <= {"time", "level", "logger", "message"} | ALLOWED, line
