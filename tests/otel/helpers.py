"""A device for the bridge's unit tests: a real signed config, a real Client with a real state
file and outbox, and the private keys to open what it queued (its shuffler never answers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from common.envelope import (
    Contribution,
    FragmentContext,
    KeyRing,
    open_contribution,
    open_fragment,
)
from common.mechanisms import krr
from common.mechanisms._histogram import parse_indices
from common.wire import (
    ChannelConfig,
    DeviceBudget,
)
from encoder_client import Client
from encoder_client.otel import EsaMetricExporter

from ..support import offline_config

EPOCH = 3600
#: k-RR at ε = 40: a report is the true value except with probability 7/e^40 < 1e-16.
SURE = 40.0


def krr_channel(channel_id: str, k: int = 8, eps: float = SURE) -> ChannelConfig:
    return ChannelConfig(
        id=channel_id,
        mechanism="krr",
        params={"k": k, "eps": eps},
        epoch_seconds=EPOCH,
        max_fragments=1,
    )


def state_channel(channel_id: str = "abroad", d: int = 8) -> ChannelConfig:
    return ChannelConfig(
        id=channel_id,
        mechanism="longitudinal",
        params={"d": d, "k": 2, "eps": 2.0},
        epoch_seconds=EPOCH,
        max_fragments=1,
    )


class Clock:
    """Time the test moves: starts 5 s into epoch 1000 of an hour-long channel."""

    def __init__(self) -> None:
        self.now = 1000 * EPOCH + 5.0

    def __call__(self) -> float:
        return self.now

    @property
    def epoch(self) -> int:
        return int(self.now // EPOCH)

    def at(self, fraction: float, epochs: int = 0) -> None:
        """Move to ``fraction`` of the current epoch plus ``epochs``."""
        self.now = (self.epoch + epochs + fraction) * EPOCH


@dataclass
class Device:
    """A client of a locally signed config whose keys the test holds."""

    client: Client
    clock: Clock
    shuffler: X25519PrivateKey
    analyzer: X25519PrivateKey
    providers: list[MeterProvider] = field(default_factory=list)

    def provider(
        self, exporter: EsaMetricExporter
    ) -> tuple[MeterProvider, PeriodicExportingMetricReader]:
        """A provider whose reader exports only when the test calls ``reader.collect()``."""
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=10**9)
        provider = MeterProvider(metric_readers=[reader], views=exporter.views())
        self.providers.append(provider)
        return provider, reader

    def contributions(self) -> list[Contribution]:
        """Every contribution queued in the outbox, opened with the shuffler's key."""
        ring = KeyRing.of(self.shuffler)
        items = self.client.state.due(float("inf"))
        return [open_contribution(item.body, "shuffler-1", ring) for item in items]

    def values(self, channel_id: str, k: int = 8) -> list[int]:
        """The k-RR values queued for ``channel_id``, opened with the analyzer's key (each
        fragment bound to its contribution's channel, epoch and crowd)."""
        ring = KeyRing.of(self.analyzer)
        fragments = [
            open_fragment(f, FragmentContext(c.channel_id, c.epoch, c.crowd_id), ring)
            for c in self.contributions()
            if c.channel_id == channel_id
            for f in c.fragments
        ]
        indices, invalid = parse_indices(krr.MECHANISM_CODE, k, fragments)
        assert invalid == 0
        return [int(i) for i in indices]

    def close(self) -> None:
        for provider in self.providers:
            provider.shutdown()
        self.client.close()


def device(tmp: Path, channels: list[ChannelConfig], overall: DeviceBudget | None = None) -> Device:
    config = offline_config(tmp, channels, overall)
    clock = Clock()
    client = Client(
        config_file=config.path,
        trust_file=config.trust_file,
        state_path=tmp / "device.db",
        background=False,
        clock=clock,
    )
    return Device(client=client, clock=clock, shuffler=config.shuffler, analyzer=config.analyzer)
