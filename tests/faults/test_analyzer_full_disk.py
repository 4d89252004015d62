"""Fault 3 of issue 49, the analyzer's side: a full disk at the analyzer.

The analyzer keeps its SQLite database on a 64 MB tmpfs the test mounts (root only: skipped
otherwise, saying so). Under load on a channel of 3-second epochs the tmpfs is filled to the
last byte until the analyzer refuses a part, kept full 4 s longer, then freed. The analyzer
must refuse what it cannot store with ``503 storage_unavailable`` (the shufflers keep the
parts and forward them again), the database must stay whole (``PRAGMA integrity_check``),
the opener must blame no part for the disk, and the load test's verification must hold:
nothing lost, nothing counted twice, no device refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .harness import Load, assert_conserved
from .scenarios import STORAGE_REFUSAL, analyzer_full_disk


def test_a_full_disk_at_the_analyzer_refuses_parts_and_they_are_forwarded_later(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs)")
    row = analyzer_full_disk(tmp_path, Load(devices=300, rate=100, seconds=27), 4.0)
    assert_conserved(row.summary, row.seen["log"])
    assert row.seen["integrity"] == "ok"
    run = row.summary["run"]
    assert run["retried"] == {} and run["errors"] == {}, run  # devices never noticed
    assert row.seen["forward_refusals"].get(STORAGE_REFUSAL, 0) > 0, row.seen
    assert row.seen["open_failures"] == 0, row.seen  # no part blamed for the disk
    assert row.recovered_seconds < 30
