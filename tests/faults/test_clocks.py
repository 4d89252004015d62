"""Fault 4 of issue 49: clocks that disagree.

shuffler-1 runs 90 s ahead of the analyzer and of shuffler-2 (libfaketime preloaded: its wall
clock alone is moved), and a tenth of the devices each run 10 minutes ahead and 10 minutes
behind, on a channel of 3-second epochs and one whose epoch outlasts the run, for 12 s of
load. What the protocol allows (docs/operations.md, "Clock skew"; docs/reliability.md):

* every contribution lands in the epoch its device's clock named, if a shuffler had that epoch
  open, or is refused ``400 epoch_not_open`` (nothing stored), and nothing else: shuffler-1
  is 30 ticks ahead, so it refuses every tick of the devices on true time; a device 10 min
  off names a tick 200 epochs away, refused by both; on the long channel all land;
* conservation holds for what was acknowledged, and every refusal is counted, by code;
* each epoch is charged at the analyzer exactly once, only epochs the run sent to, and every
  published release covers charged epochs only.

Without libfaketime the test is skipped, saying so, except in CI (``CI=true``), where it must
run (.ci/run installs Debian's ``faketime``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from .harness import LIBFAKETIME, Load
from .scenarios import LONG, clocks


def test_clocks_that_disagree_refuse_with_a_documented_error_and_charge_each_epoch_once(
    tmp_path: Path,
) -> None:
    if not LIBFAKETIME.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must install Debian's faketime: no {LIBFAKETIME}")
        pytest.skip(f"no libfaketime ({LIBFAKETIME}; Debian package faketime)")
    started = time.time()
    row = clocks(tmp_path, Load(devices=200, rate=67, seconds=12))
    summary, seen, log = row.summary, row.seen, row.seen["log"]
    assert 80 <= seen["clock_ahead"] <= 100, seen["clock_ahead"]  # the clock really moved
    check = summary["verification"]
    totals = check["conservation"]["totals"]
    assert summary["returncode"] == 0 and check["problems"] == [], log
    assert totals["lost"] == 0 and totals["purged_late"] == 0, totals
    assert totals["shufflers_acknowledged"] == totals["acknowledged"] > 0, totals
    run = summary["run"]
    # what was not acknowledged was refused 400 epoch_not_open, and nothing else happened
    assert set(run["statuses"]) == {"202", "400"}, run["statuses"]
    assert run["retried"] == {} and run["given_up"] == 0, run
    refused = run["expected_refusals"].get("epoch_not_open", 0)
    assert set(run["expected_refusals"]) == {"epoch_not_open"} and refused > 0, run
    groups = run["clocks"]
    off = sum(g["answered"] - g["acknowledged"] for g in groups.values())
    assert run["never_delivered"] == refused + off, run
    _shuffler_one_refused_every_tick(run)
    for name, group in groups.items():
        not_taken = group["answered"] - group["acknowledged"]
        assert group["refused"] == ({"epoch_not_open": not_taken} if not_taken else {}), name
        if name.startswith("ticks@"):  # 200 ticks away: no shuffler has it open
            assert group["acknowledged"] == 0 and group["answered"] > 0, (name, group)
        elif not _near_boundary(started, LONG.epoch_seconds, 700):  # the same long epoch
            assert group["acknowledged"] == group["answered"] > 0, (name, group)
    _sdk_devices_see_a_documented_refusal(seen["sdk"])
    for cid, ledger in seen["ledgers"].items():
        _charged_once(cid, ledger, check["channels"][cid])


def _shuffler_one_refused_every_tick(run: dict[str, Any]) -> None:
    """shuffler-1 (the first URL) answered only 400s to the ticks and 202s to the long
    channel; shuffler-2 acknowledged the devices on true time."""
    first, second = sorted(run["per_shuffler"].values(), key=lambda c: -c.get("400", 0))
    assert first.get("400", 0) > 0 and first.get("202", 0) > 0, run["per_shuffler"]
    assert second.get("202", 0) > first.get("202", 0), run["per_shuffler"]


def _sdk_devices_see_a_documented_refusal(devices: dict[str, dict[str, Any]]) -> None:
    """The SDK's devices: nothing left in an outbox (no retry forever); every report not
    delivered was dropped with a logged 400 epoch_not_open that asks about the clock; those
    10 min off delivered nothing (200 ticks away); those on time delivered what went to
    shuffler-2 (shuffler-1, 30 ticks ahead, refused the rest)."""
    for offset, seen in devices.items():
        assert seen["left"] == 0, (offset, seen)
        assert seen["delivered"] + len(seen["refused"]) == seen["reports"], (offset, seen)
        for message, code in seen["refused"]:
            assert code == "epoch_not_open" and "device's clock" in message, (offset, seen)
        if offset != "+0":
            assert seen["delivered"] == 0, (offset, seen)


def _near_boundary(now: float, seconds: int, margin: float) -> bool:
    """Whether ``now`` is within ``margin`` s of an epoch boundary (a device off by 10 min
    then names the next or previous long epoch)."""
    into = now % seconds
    return into < margin or seconds - into < margin


def _charged_once(cid: str, ledger: dict[str, Any], row: dict[str, Any]) -> None:
    """Each epoch of the channel's ledger charged once, only epochs of the run, every epoch
    the run's release counted contributions of charged, and every published release over
    charged epochs only."""
    charged = [int(e["epoch"]) for e in ledger["epochs"]]
    assert len(charged) == len(set(charged)), (cid, charged)
    first, last = row["epochs"]
    assert all(first <= e <= last for e in charged), (cid, charged, row["epochs"])
    received = {int(e) for e, v in row.get("per_epoch", {}).items() if v["received"] > 0}
    assert received <= set(charged), (cid, received, charged)
    for release in ledger["releases"]:
        low, high = release["epochs"]
        assert set(range(low, high + 1)) & set(charged), (cid, release, charged)
        assert release["n"] <= sum(e["n"] for e in ledger["epochs"] if low <= e["epoch"] <= high)
