"""Fault 6 of issue 49 (in part): a process stopped behind HAProxy, an opening worker killed.

shuffler-1 runs as two replicas behind HAProxy on one PostgreSQL database (a private cluster,
tests/faults/cluster.py). Under load one replica is SIGSTOPped for 8 s: HAProxy's health
check takes it out and the devices' new contributions go to the other, while what the
stopped one had received waits; then it continues. While verification drains the parts, one
of the analyzer's opening worker processes is SIGKILLed (its pool is started afresh). The
load test's verification must hold: nothing lost, nothing counted twice.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .cluster import binaries
from .harness import Load, assert_conserved
from .scenarios import stopped_replica


def test_a_stopped_replica_and_a_killed_opening_worker_lose_nothing(tmp_path: Path) -> None:
    bin = binaries()
    if bin is None or shutil.which("haproxy") is None:
        pytest.skip("needs PostgreSQL's server binaries and haproxy")
    row = stopped_replica(tmp_path, Load(devices=1500, rate=100, seconds=30), 8.0, bin)
    assert_conserved(row.summary, row.seen["log"])
    assert row.seen["killed_workers"] == 1
    assert row.recovered_seconds < 30
