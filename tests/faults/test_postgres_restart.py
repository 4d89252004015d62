"""Fault 1 of issue 49: a trust domain's PostgreSQL restarted mid-ingest, down for seconds.

shuffler-1's database is on a private cluster the test creates (tests/faults/cluster.py; the
machine's shared server is untouched); shuffler-2 and the analyzer keep SQLite. Under load,
the cluster is stopped (``pg_ctl stop -m fast``) for 5 s and started again. shuffler-1 must
refuse with 503 while it cannot commit (never 202 for what it did not store: the ledger it
reads from its database equals what the devices saw acknowledged), ``/readyz`` must say so,
the devices wait the refusals out, and batching and forwarding resume by themselves: the
load test's verification holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cluster import binaries
from .harness import Load, assert_conserved
from .scenarios import postgres_restart


def test_a_restarted_database_is_waited_out_and_nothing_is_lost(tmp_path: Path) -> None:
    bin = binaries()
    if bin is None:
        pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql")
    row = postgres_restart(tmp_path, Load(devices=1500, rate=100, seconds=30), 5.0, bin)
    assert_conserved(row.summary, row.seen["log"])
    run = row.summary["run"]
    assert set(run["retried"]) == {"503"} and run["retried"]["503"] > 0, run
    assert run["refused_then_delivered"] > 0 and set(run["errors"]) == {"503"}, run
    assert row.seen["readyz"].get(503, 0) > 0 and row.seen["readyz"].get(200, 0) > 0, row.seen
    assert row.recovered_seconds < 30
