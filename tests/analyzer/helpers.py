"""Shared pieces of the analyzer tests: a channel, keys, signed batches and the layers wired
over a real database (SQLite or PostgreSQL)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.channels import ChannelRuntime
from analyzer.intake import BatchIntake, Intake, IntakePolicy
from analyzer.ledger import LedgerService
from analyzer.metrics import Events
from analyzer.opening import FragmentOpener, PartOpener
from analyzer.releases import ReleaseService
from analyzer.service import MIGRATIONS
from analyzer.store import AnalyzerStore
from common.envelope import KeyRing, seal_fragment, sign
from common.mechanisms import krappor
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig, b64
from services.runtime import db

CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 20, "eps": 4.0},
    min_crowd=50,
    max_fragments=20,
    delta=1e-8,
    payload_size=16,
)
ANALYZER_KEY = X25519PrivateKey.generate()
SHUFFLERS = {"shuffler-1": Ed25519PrivateKey.generate(), "shuffler-2": Ed25519PrivateKey.generate()}
#: 1,000 contributions over 5 values (the rest of the 20 bins are empty).
VALUES = np.repeat(np.arange(5), [400, 300, 200, 80, 20])


@dataclass(frozen=True)
class Layers:
    """The analyzer's layers over one database, as the service wires them."""

    store: AnalyzerStore
    intake: BatchIntake
    releases: ReleaseService
    ledger: LedgerService
    events: Events
    opener: PartOpener

    def deliver(self, body: bytes, signature: str) -> Intake:
        """Store a part and open everything stored (what the background opener does)."""
        intake = self.intake.accept(body, signature)
        self.opener.open_pending()
        return intake


def build(url: str, channels: Iterable[ChannelConfig] = (CHANNEL,)) -> Layers:
    """The layers over ``url`` (migrated), trusting :data:`SHUFFLERS` and :data:`ANALYZER_KEY`."""
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    runtimes = {c.id: ChannelRuntime.build(c, sorted(SHUFFLERS)) for c in channels}
    store, events = AnalyzerStore(engine), Events()
    policy = IntakePolicy(
        ring=KeyRing.of(ANALYZER_KEY),
        channels=runtimes,
        shufflers={k: v.public_key() for k, v in SHUFFLERS.items()},
        max_batch_bytes=64 * 1024 * 1024,
    )
    return Layers(
        store,
        BatchIntake(store, policy, events),
        ReleaseService(store, runtimes, events),
        LedgerService(store, runtimes),
        events,
        PartOpener(store, runtimes, FragmentOpener(policy.ring, 1, 500), events),
    )


def signed(batch: Batch, shuffler: str = "shuffler-1") -> tuple[bytes, str]:
    """A batch's body and its shuffler's signature."""
    body = batch.body()
    return body, b64(sign(body, SHUFFLERS[shuffler]))


def make_batch(
    values: npt.NDArray[np.int64],
    epoch: int = 7,
    shuffler: str = "shuffler-1",
    seed: int = 0,
    chaff: int = 0,
) -> tuple[bytes, str]:
    """A signed batch of k-RAPPOR reports of ``values`` (seeded), plus ``chaff`` random
    fragments."""
    params = krappor.KRapporParams(k=20, eps=4.0)
    rng = SeededSource(seed)
    fragments = [
        seal_fragment(f, CHANNEL.id, 16, ANALYZER_KEY.public_key())
        for v in values
        for f in krappor.encode(int(v), params, rng)
    ]
    fragments += [secrets.token_bytes(len(fragments[0])) for _ in range(chaff)]
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id=shuffler,
        channel_id=CHANNEL.id,
        crowd_id="",
        epoch=epoch,
        n_contributions=len(values),
        fragments=[b64(f) for f in fragments],
    )
    return signed(batch, shuffler)


def counter(url: str, name: str) -> float:
    """An ``esa_analyzer_<name>_total`` counter of a running analyzer (0 if absent)."""
    text = httpx.get(url + "/metrics").text
    found = re.search(rf"^esa_analyzer_{name}_total (\S+)$", text, re.MULTILINE)
    return 0.0 if found is None else float(found.group(1))
