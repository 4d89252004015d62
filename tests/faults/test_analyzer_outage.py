"""Fault 2 of issue 49: the analyzer unreachable for several epochs under load.

A channel of 3-second epochs; two shufflers keep taking contributions while the analyzer is
stopped for 9 s (three epochs) of a 30-second run, close those epochs and hold their parts,
then forward them when it is back. The load test's verification must hold: every
acknowledged contribution received, deleted or held, nothing lost or counted twice, every
contribution delivered at once (the shufflers never refused a device because the analyzer
was away).
"""

from __future__ import annotations

from pathlib import Path

from .harness import Load, assert_conserved
from .scenarios import analyzer_outage


def test_the_shufflers_hold_parts_while_the_analyzer_is_down_and_forward_them_after(
    tmp_path: Path,
) -> None:
    row = analyzer_outage(tmp_path, Load(devices=300, rate=100, seconds=30), down_seconds=9)
    log = row.seen["log"]
    assert_conserved(row.summary, log)
    assert row.seen["held_parts"] > 0  # epochs closed and held during the outage
    run = row.summary["run"]
    assert run["retried"] == {} and run["errors"] == {}, run  # devices never noticed
    assert row.recovered_seconds < 30
