"""Fault 3 of issue 49: a full disk at a shuffler.

shuffler-1 keeps its SQLite database on a 64 MB tmpfs the test mounts (root only: skipped
otherwise, saying so). Under load the tmpfs is filled to the last byte for 4 s, then freed.
Writes must be refused with ``503 storage_unavailable`` (nothing stored, ``Retry-After``),
the database must stay whole (``PRAGMA integrity_check``: nothing half-written), intake must
resume once space returns, and the load test's verification must hold.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .harness import Load, assert_conserved
from .scenarios import full_disk


def test_a_full_disk_refuses_writes_and_intake_resumes_when_space_returns(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs)")
    row = full_disk(tmp_path, Load(devices=1500, rate=100, seconds=30), full_seconds=4.0)
    assert_conserved(row.summary, row.seen["log"])
    assert row.seen["integrity"] == "ok"
    run = row.summary["run"]
    assert set(run["retried"]) == {"503"} and run["refused_then_delivered"] > 0, run
    assert row.recovered_seconds < 30
