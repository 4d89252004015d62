"""Fault 5 of issue 49, the devices' side: a bad network between devices and a shuffler.

The load test's devices reach shuffler-1 through a fault proxy (tests/faults/proxy.py,
registered as shuffler-1's URL) that, under load, first adds 0.5 s to every chunk either way,
then cuts every third contribution (half of it sent, or all of it sent and its 202 dropped),
then heals. The devices must retry what broke; a contribution stored whose 202 was lost is
sent again, answered 409 ``replayed_nonce`` and must be counted once: the load test's
verification (acknowledged = what the shufflers' ledgers hold) holds.
"""

from __future__ import annotations

from pathlib import Path

from .harness import Load, assert_conserved
from .scenarios import bad_device_network


def test_devices_retry_through_a_lossy_link_and_each_contribution_counts_once(
    tmp_path: Path,
) -> None:
    row = bad_device_network(tmp_path, Load(devices=1500, rate=100, seconds=24), 5.0)
    assert_conserved(row.summary, row.seen["log"])
    assert row.seen["cut_requests"] > 0 and row.seen["cut_answers"] > 0, row.seen
    run = row.summary["run"]
    broken = sum(v for k, v in run["errors"].items() if not k.isdigit())
    assert broken > 0, run  # the devices saw the resets
    # dropped 202s were sent again and recognised (409 replayed_nonce); a retry may be cut
    # again, so one contribution may account for several cut answers
    assert 0 < run["recovered"] <= row.seen["cut_answers"], (run, row.seen)
    # ... by its nonce: shuffler-1 refused at least that many as replayed (a 409 can be cut
    # too, and then sent again)
    assert row.seen["replayed_nonce"] >= run["recovered"], (run, row.seen)
    assert run["retried"] == {} and run["never_delivered"] == 0, run
    assert row.recovered_seconds < 30
