"""Fault 1 of issue 49, the analyzer's side: its PostgreSQL restarted mid-ingest.

The analyzer's database is on a private cluster the test creates (tests/faults/cluster.py;
the shufflers keep SQLite). Under load on a channel of 3-second epochs, while parts arrive
and are opened, the cluster is stopped (``pg_ctl stop -m fast``) for 5 s and started again.
The analyzer must refuse the parts it cannot commit with ``503 storage_unavailable`` (the
shufflers keep them and forward them again), ``/readyz`` must say so, the opener must blame
no part for the database's failure, and the load test's verification must hold: nothing
lost, nothing counted twice, no device refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cluster import binaries
from .harness import Load, assert_conserved
from .scenarios import STORAGE_REFUSAL, analyzer_postgres_restart


def test_the_analyzers_restarted_database_is_waited_out_by_the_shufflers(
    tmp_path: Path,
) -> None:
    bin = binaries()
    if bin is None:
        pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql")
    row = analyzer_postgres_restart(tmp_path, Load(devices=300, rate=100, seconds=27), 5.0, bin)
    assert_conserved(row.summary, row.seen["log"])
    run = row.summary["run"]
    assert run["retried"] == {} and run["errors"] == {}, run  # devices never noticed
    refused = row.seen["forward_refusals"]
    assert refused.get(STORAGE_REFUSAL, 0) > 0, refused
    assert row.seen["readyz"].get(503, 0) > 0 and row.seen["readyz"].get(200, 0) > 0, row.seen
    assert row.seen["open_failures"] == 0, row.seen  # no part blamed for the database
    assert row.recovered_seconds < 30
