"""Fault 5 of issue 49: a bad network between the shufflers and the analyzer.

Both shufflers reach the analyzer through a fault proxy (tests/faults/proxy.py) that, under
load on a channel of 3-second epochs, first adds 2 s to every chunk either way, then resets
every part's connection (half the part sent, or the whole part sent and its answer dropped),
then heals. Delivery must complete after the heal, and a part the analyzer stored but whose
acknowledgement was lost must not be counted twice: the load test's verification holds.

Every party keeps its own database on PostgreSQL (a private cluster, tests/faults/cluster.py),
as a deployment does: the analyzer-outage test covers the same path on SQLite, and
``benchmarks/faults.py`` runs both faults on both backends (docs/reliability.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cluster import binaries
from .harness import Load, assert_conserved
from .scenarios import bad_network, every_party_on_postgres


def test_parts_survive_a_slow_then_resetting_link_and_count_once(tmp_path: Path) -> None:
    bin = binaries()
    if bin is None:
        pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql")
    with every_party_on_postgres(bin) as databases:
        row = bad_network(
            tmp_path, Load(devices=300, rate=100, seconds=27), fault_seconds=6, databases=databases
        )
    assert row.backend == "PostgreSQL"
    assert_conserved(row.summary, row.seen["log"])
    assert row.seen["cut_requests"] > 0 and row.seen["cut_answers"] > 0, row.seen
    run = row.summary["run"]
    assert run["retried"] == {} and run["errors"] == {}, run  # devices never noticed
    assert row.recovered_seconds < 30
