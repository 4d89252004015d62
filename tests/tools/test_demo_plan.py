"""When the demo replays its histogram requests (services/tools/demo.py): never across an
epoch boundary, since a request left over at the boundary would be refused as late."""

from __future__ import annotations

import pytest

from services.tools.demo import seconds_to_wait


def test_no_wait_when_the_replay_fits_before_the_epoch_ends() -> None:
    assert seconds_to_wait(1000.0, [3600], guard=100.0) == 0.0  # 2,600 s left
    assert seconds_to_wait(3500.0, [3600], guard=100.0) == 0.0  # exactly the guard left


def test_waits_for_the_next_epoch_when_the_replay_would_cross_it() -> None:
    assert seconds_to_wait(3550.0, [3600], guard=100.0) == pytest.approx(50.1)
    assert seconds_to_wait(7199.5, [3600], guard=3.0) == pytest.approx(0.6)


def test_the_channel_whose_epoch_ends_first_decides() -> None:
    # 10-second and hourly channels at t = 3595: the short epoch ends in 5 s, the hour too.
    assert seconds_to_wait(3595.0, [10, 3600], guard=8.0) == pytest.approx(5.1)
    # At t = 1005 the 10-second epoch ends in 5 s, the hour in 2,595 s: the short one decides.
    assert seconds_to_wait(1005.0, [3600, 10], guard=8.0) == pytest.approx(5.1)
    assert seconds_to_wait(1001.0, [3600, 10], guard=8.0) == 0.0
