"""The device-side local-ε budget (issue 13, item 4): the SDK refuses, persistently, a report
that would spend more local ε than the signed config allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.wire import (
    ChannelConfig,
    DeviceBudget,
)
from encoder_client import BudgetExceededError, Client, EsaError

from ..support import offline_config

EPOCH = 3600
#: k-RAPPOR at ε = 1: removal ε 1, replacement ε 2 per report.
PER_REPORT = 2.0


def _channel(channel_id: str, budget: DeviceBudget | None) -> ChannelConfig:
    return ChannelConfig(
        id=channel_id,
        mechanism="krappor",
        params={"k": 8, "eps": 1.0},
        epoch_seconds=EPOCH,
        max_fragments=8,
        budget=budget,
    )


def _config_file(
    tmp: Path, channels: list[ChannelConfig], overall: DeviceBudget | None = None
) -> tuple[Path, Path]:
    config = offline_config(tmp, channels, overall)
    return config.path, config.trust_file


class Clock:
    """Epoch-aligned time the test moves forward."""

    def __init__(self) -> None:
        self.now = 1_000 * EPOCH + 5.0

    def __call__(self) -> float:
        return self.now

    def next_epoch(self, epochs: int = 1) -> None:
        self.now += epochs * EPOCH


def _client(tmp: Path, config: tuple[Path, Path], clock: Clock) -> Client:
    path, trust = config
    return Client(
        config_file=path,
        trust_file=trust,
        state_path=tmp / "state.sqlite",
        background=False,
        clock=clock,
    )


def test_lifetime_budget_is_enforced_and_survives_a_restart(tmp_path: Path) -> None:
    config = _config_file(tmp_path, [_channel("pages", DeviceBudget(lifetime_eps=2 * PER_REPORT))])
    clock = Clock()
    with _client(tmp_path, config, clock) as client:
        for _ in range(2):
            client.histogram("pages").report(3)
            clock.next_epoch()
        assert client.budget_spent("pages") == pytest.approx(2 * PER_REPORT)
        outbox = client.state.outbox_size()
        with pytest.raises(BudgetExceededError, match="lifetime budget ε=4 of channel 'pages'"):
            client.histogram("pages").report(3)
        assert client.state.outbox_size() == outbox  # nothing queued for the refused report
    clock.next_epoch(100)
    with _client(tmp_path, config, clock) as again:
        with pytest.raises(EsaError):
            again.histogram("pages").report(1)
        assert again.budget_spent() == pytest.approx(2 * PER_REPORT)


def test_rolling_window_frees_budget_as_epochs_age(tmp_path: Path) -> None:
    budget = DeviceBudget(window_eps=PER_REPORT, window_seconds=2 * EPOCH)
    config = _config_file(tmp_path, [_channel("pages", budget)])
    clock = Clock()
    with _client(tmp_path, config, clock) as client:
        client.histogram("pages").report(0)
        clock.next_epoch()
        with pytest.raises(BudgetExceededError, match="rolling window"):
            client.histogram("pages").report(0)
        clock.next_epoch()  # the first report's epoch is now outside the window
        client.histogram("pages").report(0)
        assert client.budget_spent("pages") == pytest.approx(2 * PER_REPORT)


def test_device_budget_covers_every_channel_together(tmp_path: Path) -> None:
    channels = [_channel("pages", None), _channel("errors", None)]
    config = _config_file(tmp_path, channels, DeviceBudget(lifetime_eps=3 * PER_REPORT))
    clock = Clock()
    with _client(tmp_path, config, clock) as client:
        client.histogram("pages").report(1)
        client.histogram("errors").report(2)
        clock.next_epoch()
        client.histogram("pages").report(1)
        with pytest.raises(BudgetExceededError, match="all channels"):
            client.histogram("errors").report(2)
        # the refused report did not use up the epoch: it stays refused, not "already reported"
        with pytest.raises(BudgetExceededError):
            client.histogram("errors").report(2)


def test_a_budget_needs_a_complete_window() -> None:
    with pytest.raises(ValueError, match="go together"):
        DeviceBudget(window_eps=1.0)
    with pytest.raises(ValueError, match="needs lifetime_eps"):
        DeviceBudget()
