"""A device for the bridge's unit tests: a real signed config, a real Client with a real state
file and outbox, and the private keys to open what it queued (its shuffler never answers)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from common.collection import sign_config
from common.envelope import (
    Contribution,
    KeyRing,
    key_id,
    open_contribution,
    open_fragment,
    public_bytes,
    public_identity,
)
from common.mechanisms import krr
from common.mechanisms._base import parse_indices
from common.wire import (
    AnalyzerInfo,
    AnalyzerKey,
    ChannelConfig,
    CollectionConfig,
    DeviceBudget,
    ShufflerInfo,
    b64,
)
from encoder_client import Client
from encoder_client.otel import EsaMetricExporter

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
        """The k-RR values queued for ``channel_id``, opened with the analyzer's key."""
        ring = KeyRing.of(self.analyzer)
        fragments = [
            open_fragment(f, channel_id, ring)
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
    signer, analyzer = Ed25519PrivateKey.generate(), X25519PrivateKey.generate()
    shuffler = X25519PrivateKey.generate()
    identity = public_identity(shuffler.public_key(), Ed25519PrivateKey.generate().public_key())
    # Port 9 (discard): nobody listens, so everything queued stays in the outbox.
    info = ShufflerInfo(id="shuffler-1", url="http://127.0.0.1:9", **identity)
    key = AnalyzerKey(
        key_id=key_id(analyzer.public_key()).hex(),
        public_key=b64(public_bytes(analyzer.public_key())),
    )
    analyzer_info = AnalyzerInfo(
        url="http://127.0.0.1:9", keys=[key], signing_key=b64(public_bytes(signer.public_key()))
    )
    now = int(time.time())
    config = CollectionConfig(
        issued_at=now,
        expires_at=now + 10**10,
        analyzer=analyzer_info,
        shufflers=[info],
        channels=channels,
        device_budget=overall,
    )
    path = tmp / "config.json"
    path.write_text(sign_config(config, signer).model_dump_json())
    clock = Clock()
    client = Client(
        config_file=path,
        trusted_key=b64(public_bytes(signer.public_key())),
        state_path=tmp / "device.db",
        background=False,
        clock=clock,
    )
    return Device(client, clock, shuffler, analyzer)
