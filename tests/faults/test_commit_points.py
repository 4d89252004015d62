"""Fault 7 of issue 49: a crash at every commit point of the shufflers' epoch close and the
analyzer's fold, and restarting completes the epoch exactly once.

One deployment (:func:`tests.faults.scenarios.commit_points`): shuffler-1 on SQLite and
shuffler-2 on PostgreSQL (when the machine's server answers) each die by their own SIGKILL at
every point of :data:`~tests.faults.scenarios.SHUFFLER_POINTS` in turn (``ESA_FAILPOINTS``,
runtime/failpoints.py), the analyzer at every point of
:data:`~tests.faults.scenarios.ANALYZER_POINTS` while their batches arrive and when the load
test's verification closes the epoch, and at both points of a release's record when one is
published after it. Each crash is followed by a restart armed with the next point (which
recovers from the one before), the last by an unarmed one. The load test's verification is
the judge: acknowledged = received at the analyzer + deleted + held, nothing counted twice;
each shuffler dealt one batch of the epoch and the release's n is the contributions the
shufflers forwarded in them.
"""

from __future__ import annotations

import secrets
import signal
from collections.abc import Iterator

import pytest

from tests.conftest import POSTGRES, _admin_or_skip

from .harness import Load, Row, assert_conserved
from .scenarios import ANALYZER_POINTS, RELEASE_POINTS, SHUFFLER_POINTS, Crash, commit_points


@pytest.fixture(scope="module")
def postgres_database() -> Iterator[str | None]:
    """A fresh database on the machine's PostgreSQL for shuffler-2 (None: no server; the
    shuffler's points are then crashed on SQLite only)."""
    try:
        admin = _admin_or_skip()
    except pytest.skip.Exception:
        yield None
        return
    name = f"esa_test_{secrets.token_hex(6)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    user, _, hostport = POSTGRES.partition("@")
    try:
        yield f"postgresql+psycopg://{user}@{hostport}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory, postgres_database: str | None) -> Row:
    databases = {"shuffler-2": postgres_database} if postgres_database else None
    return commit_points(
        tmp_path_factory.mktemp("points"), Load(devices=300, rate=100, seconds=5), databases
    )


def _crashes(row: Row, process: str) -> dict[str, Crash]:
    return {crash.point: crash for crash in row.seen["crashes"][process]}


@pytest.mark.parametrize("point", SHUFFLER_POINTS)
def test_the_shuffler_died_at_the_point(crashed: Row, point: str) -> None:
    for process in [p for p in crashed.seen["crashes"] if p.startswith("shuffler-")]:
        crash = _crashes(crashed, process)[point]
        assert crash.returncode == -signal.SIGKILL, (process, crash)
        assert crash.logged, (process, crash)


@pytest.mark.parametrize("point", ANALYZER_POINTS + RELEASE_POINTS)
def test_the_analyzer_died_at_the_point(crashed: Row, point: str) -> None:
    crash = {**_crashes(crashed, "analyzer"), **_crashes(crashed, "analyzer release")}[point]
    assert crash.returncode == -signal.SIGKILL, crash
    assert crash.logged, crash


def test_restarting_completes_the_epoch_exactly_once(crashed: Row) -> None:
    assert_conserved(crashed.summary, crashed.seen["log"])
    totals = crashed.summary["verification"]["conservation"]["totals"]
    assert totals["lost"] == 0  # neither lost nor counted twice
    # one batch per shuffler for the epoch, every one forwarded, and the release holds
    # exactly the contributions they carry
    batches = [count for count, _ in crashed.seen["forwarded"]]
    assert batches == [1] * len(batches), crashed.seen["forwarded"]
    forwarded = sum(n for _, n in crashed.seen["forwarded"])
    assert totals["received_at_analyzer"] == forwarded > 0, (totals, crashed.seen["forwarded"])
    # the publish cut before its commit left nothing, the one cut after it its one record
    assert crashed.seen["releases"] == 1
    assert crashed.recovered_seconds < 60
