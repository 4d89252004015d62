"""Shared pieces of the analyzer tests: a channel, keys, signed batches and the layers wired
over a real database (SQLite or PostgreSQL).

Batches are what an honest shuffler sends unless a test says otherwise: real k-RAPPOR reports
sealed for the batch's channel, epoch and crowd (:class:`FragmentContext`), ``n_contributions``
the number of reports they came from, signed by the shuffler the ``ESA-Shuffler`` header
names (:class:`Signed`), one batch per (shuffler, channel, crowd, epoch)."""

from __future__ import annotations

import base64
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.channels import ChannelRuntime
from analyzer.intake import BatchIntake, IntakePolicy, PartIntake
from analyzer.ledger import LedgerService
from analyzer.metrics import AnalyzerEvents
from analyzer.opening import FragmentOpener, PartOpener
from analyzer.releases import EpochCloser, ReleaseService
from analyzer.service import MIGRATIONS
from analyzer.settings import AnalyzerSettings
from analyzer.store import AnalyzerStore
from common.envelope import FragmentContext, KeyRing, seal_fragment, sign
from common.mechanisms import krappor
from common.preauth import PREAUTH_HEADER, preauth_header
from common.randomness import SeededSource
from common.wire import Batch, ChannelConfig, ShufflerEntry, b64
from runtime import db

from ..support import descriptor, registry_entry

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
SHUFFLERS = {f"shuffler-{i}": Ed25519PrivateKey.generate() for i in (1, 2, 3)}
#: 1,000 contributions over 5 values (the rest of the 20 bins are empty).
VALUES = np.repeat(np.arange(5), [400, 300, 200, 80, 20])


@dataclass(frozen=True)
class Layers:
    """The analyzer's layers over one database, as the service wires them."""

    store: AnalyzerStore
    intake: BatchIntake
    releases: ReleaseService
    ledger: LedgerService
    events: AnalyzerEvents
    opener: PartOpener
    closer: EpochCloser

    def deliver(self, body: bytes, signature: str, shuffler: str = "shuffler-1") -> PartIntake:
        """Store a part sent by ``shuffler``, open everything stored (what the background
        opener does) and close the groups whose close timeout passed (the background closer:
        with the real clock, every epoch of these tests is long over)."""
        intake = self.intake.accept(body, signature, shuffler)
        self.opener.open_pending()
        self.closer.close_due()
        return intake

    def deliver_all(self, *parts: Signed) -> None:
        """Store several parts, then open everything and close what is due: batches that all
        arrived before their epoch closed."""
        for part in parts:
            self.intake.accept(*part)
        self.opener.open_pending()
        self.closer.close_due()


def build(
    url: str,
    channels: Iterable[ChannelConfig] = (CHANNEL,),
    clock: Callable[[], float] = time.time,
    close_seconds: float = 0.0,
) -> Layers:
    """The layers over ``url`` (migrated), trusting :data:`SHUFFLERS` and :data:`ANALYZER_KEY`;
    epochs close ``close_seconds`` after their end by ``clock``."""
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    runtimes = {c.id: ChannelRuntime.build(c, sorted(SHUFFLERS)) for c in channels}
    store, events = AnalyzerStore(engine, clock), AnalyzerEvents()
    policy = IntakePolicy(
        ring=KeyRing.of(ANALYZER_KEY),
        channels=runtimes,
        shufflers={k: v.public_key() for k, v in SHUFFLERS.items()},
        max_batch_bytes=64 * 1024 * 1024,
    )
    return Layers(
        store=store,
        intake=BatchIntake(store, policy, events),
        releases=ReleaseService(store, runtimes, events),
        ledger=LedgerService(store, runtimes),
        events=events,
        opener=PartOpener(store, runtimes, FragmentOpener(policy.ring, 1, 500), events),
        closer=EpochCloser(store, runtimes, close_seconds, events, clock),
    )


class Clock:
    """A clock a test sets (``clock.now``)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Signed(NamedTuple):
    """A part as a shuffler posts it: the body, its ``ESA-Signature`` and the ``ESA-Shuffler``
    header (``accept(*signed)`` and ``deliver(*signed)`` take the three in this order)."""

    body: bytes
    signature: str
    shuffler: str

    @property
    def headers(self) -> dict[str, str]:
        """The HTTP headers it is posted with."""
        key = SHUFFLERS.get(self.shuffler, SHUFFLERS["shuffler-1"])
        preauth = preauth_header(self.shuffler, self.body, key, time.time())
        return {
            "ESA-Signature": self.signature,
            "ESA-Shuffler": self.shuffler,
            PREAUTH_HEADER: preauth,
        }


def signed(batch: Batch, shuffler: str | None = None) -> Signed:
    """A batch's body signed by ``shuffler`` (default: the one it names), sent as that
    shuffler."""
    sender = shuffler or batch.shuffler_id
    body = batch.body()
    return Signed(body, b64(sign(body, SHUFFLERS[sender])), sender)


def seal(
    fragments: Iterable[bytes], channel: ChannelConfig, epoch: int, crowd: str = ""
) -> list[str]:
    """Fragments sealed for the analyzer, bound to a batch's channel, epoch and crowd, base64
    as a batch carries them."""
    context = FragmentContext(channel.id, epoch, crowd)
    key = ANALYZER_KEY.public_key()
    return [b64(seal_fragment(f, context, channel.payload_size, key)) for f in fragments]


def reports(values: npt.NDArray[np.int64], seed: int = 0) -> list[bytes]:
    """The k-RAPPOR fragments of one report per value of :data:`CHANNEL` (seeded)."""
    params = krappor.KRapporParams(k=20, eps=4.0)
    rng = SeededSource(seed)
    return [f for v in values for f in krappor.KRappor().encode_value(params, int(v), rng)]


def make_batch(
    values: npt.NDArray[np.int64],
    epoch: int = 7,
    shuffler: str = "shuffler-1",
    seed: int = 0,
    chaff: int = 0,
    crowd: str = "",
) -> Signed:
    """A signed batch of k-RAPPOR reports of ``values`` (seeded) for ``epoch`` and ``crowd``,
    plus ``chaff`` random fragments (which no key opens)."""
    fragments = seal(reports(values, seed), CHANNEL, epoch, crowd)
    size = len(base64.b64decode(fragments[0]))
    fragments += [b64(secrets.token_bytes(size)) for _ in range(chaff)]
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id=shuffler,
        channel_id=CHANNEL.id,
        crowd_id=crowd,
        epoch=epoch,
        n_contributions=len(values),
        fragments=fragments,
    )
    return signed(batch)


def seeded_entry(
    shuffler_id: str, signer: Ed25519PrivateKey, url: str = "http://127.0.0.1:1"
) -> dict[str, object]:
    """A registry entry for an analyzer process, seeded with the shuffler's own signed
    descriptor (so ``/v1/config`` needs no shuffler running)."""
    own = descriptor(signer, X25519PrivateKey.generate(), shuffler_id, url)
    return {**registry_entry(shuffler_id, url, signer), "descriptor": own.model_dump(mode="json")}


def post(url: str, part: Signed) -> httpx.Response:
    """POST a part to a running analyzer as its shuffler does."""
    return httpx.post(url + "/v1/batches", content=part.body, headers=part.headers, timeout=30)


def counter(url: str, name: str) -> float:
    """An ``esa_analyzer_<name>_total`` counter of a running analyzer (0 if absent)."""
    text = httpx.get(url + "/metrics").text
    found = re.search(rf"^esa_analyzer_{name}_total (\S+)$", text, re.MULTILINE)
    return 0.0 if found is None else float(found.group(1))


#: The test app's ``max_batch_bytes``.
CAP = 4 * 1024 * 1024
#: Each shuffler's own signed descriptor (its HPKE key is irrelevant here).
DESCRIPTORS = {
    name: descriptor(key, X25519PrivateKey.generate(), name, "http://127.0.0.1:1")
    for name, key in SHUFFLERS.items()
}


def app_settings(tmp_path: Path) -> AnalyzerSettings:
    """Settings of an analyzer app over a SQLite file under ``tmp_path``, trusting
    :data:`SHUFFLERS` (their descriptors seeded: nothing to fetch); it opens fragments sealed
    to :data:`ANALYZER_KEY` (written as its current HPKE key)."""
    from cryptography.hazmat.primitives import serialization

    keys = tmp_path / "keys"
    keys.mkdir(parents=True)
    (keys / "hpke.pem").write_bytes(
        ANALYZER_KEY.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    # each shuffler's registry entry seeded with its own signed descriptor (nothing to fetch)
    shufflers = [
        ShufflerEntry.model_validate(
            {
                **registry_entry(name, "http://127.0.0.1:1", key),
                "descriptor": DESCRIPTORS[name].model_dump(mode="json"),
            }
        )
        for name, key in SHUFFLERS.items()
    ]
    settings = AnalyzerSettings(
        database_url=f"sqlite:///{tmp_path / 'analyzer.db'}",
        key_dir=keys,
        channels=[CHANNEL],
        channels_file=None,
        shufflers=shufflers,
        shufflers_file=None,
        max_batch_bytes=CAP,
        opening_processes=1,
        epoch_close_seconds=0.0,
        epoch_close_poll_seconds=0.05,
    )
    return settings


def crowd(
    values: npt.NDArray[np.int64],
    seed: int = 0,
    *,
    claimed: int | None = None,
    invalid: int = 0,
    kept: int | None = None,
) -> int:
    """The crowd the analyzer verifies for ``make_batch(values, seed=seed)`` (its first
    ``kept`` fragments only, if given): the lower confidence bound its fragments prove
    (:meth:`FragmentCount.verified_crowd`), a few percent below the honest crowd, never above
    the claim."""
    law = ChannelRuntime.build(CHANNEL, sorted(SHUFFLERS)).fragment_count("shuffler-1")
    n = len(values) if claimed is None else claimed
    valid = len(reports(values, seed))
    return law.verified_crowd(n, valid if kept is None else min(kept, valid), invalid)


def estimated(
    values: npt.NDArray[np.int64],
    seed: int = 0,
    *,
    claimed: int | None = None,
    invalid: int = 0,
    kept: int | None = None,
) -> int:
    """The crowd the analyzer's estimate of ``make_batch(values, seed=seed)`` rests on (its
    first ``kept`` fragments only, if given): the claim held within what its fragments allow
    (:meth:`FragmentCount.estimated_crowd`), the honest crowd itself for an honest batch."""
    law = ChannelRuntime.build(CHANNEL, sorted(SHUFFLERS)).fragment_count("shuffler-1")
    n = len(values) if claimed is None else claimed
    valid = len(reports(values, seed))
    return law.estimated_crowd(n, valid if kept is None else min(kept, valid), invalid)
