"""The analyzer as one object: what the HTTP routes call, built from settings.

It wires intake, releases and the ledger over one :class:`~analyzer.store.AnalyzerStore` and
answers in :mod:`common.wire` models; every refusal is an :class:`~analyzer.errors.AnalyzerError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from analyzer.channels import ChannelRuntime
from analyzer.config import AnalyzerKeys, signed_config
from analyzer.dashboard import ChannelView
from analyzer.intake import BatchIntake, IntakePolicy
from analyzer.ledger import LedgerService
from analyzer.metrics import Events
from analyzer.releases import DEFAULT_TOP, ReleaseService
from analyzer.settings import AnalyzerSettings
from analyzer.store import AnalyzerStore
from common.envelope import load_ed25519_public
from common.wire import (
    BatchAck,
    ChannelList,
    ChannelSummary,
    Ledger,
    ReleaseBody,
    SignedConfig,
    unb64,
)
from services.runtime import db

log = logging.getLogger("esa.analyzer")
MIGRATIONS = Path(__file__).parent / "migrations"


@dataclass(frozen=True)
class AnalyzerService:
    """Intake, releases, ledger and the signed config of one analyzer."""

    settings: AnalyzerSettings
    keys: AnalyzerKeys
    store: AnalyzerStore
    intake: BatchIntake
    releases: ReleaseService
    ledger: LedgerService
    events: Events
    clock: Callable[[], float] = time.time

    @classmethod
    def from_settings(
        cls, settings: AnalyzerSettings, clock: Callable[[], float] = time.time
    ) -> AnalyzerService:
        """Load keys, validate channels and open the database named by ``settings``.

        Raises:
            InvalidChannelError: if a configured channel does not validate.
        """
        keys = AnalyzerKeys.load(settings.key_dir)
        shuffler_ids = [s.id for s in settings.shufflers]
        channels = {c.id: ChannelRuntime.build(c, shuffler_ids) for c in settings.channels}
        policy = IntakePolicy(
            ring=keys.ring(),
            channels=channels,
            shufflers={s.id: load_ed25519_public(unb64(s.signing_key)) for s in settings.shufflers},
            max_batch_bytes=settings.max_batch_bytes,
        )
        store = AnalyzerStore(db.make_engine(settings.database_url), clock)
        events = Events()
        return cls(
            settings,
            keys,
            store,
            BatchIntake(store, policy, events),
            ReleaseService(store, channels, events),
            LedgerService(store, channels),
            events,
            clock,
        )

    def start(self) -> None:
        """Wait for the database and upgrade its schema (the pre-start step)."""
        db.wait_for(self.store.engine)
        db.upgrade(self.store.engine, MIGRATIONS)
        log.info(
            "analyzer ready",
            extra={
                "channels": [c.id for c in self.settings.channels],
                "shufflers": [s.id for s in self.settings.shufflers],
            },
        )

    def close(self) -> None:
        """Release the database connections."""
        self.store.engine.dispose()

    def accept(self, body: bytes, signature: str | None) -> BatchAck:
        """``POST /v1/batches`` (see :meth:`BatchIntake.accept`)."""
        intake = self.intake.accept(body, signature)
        if intake.duplicate:
            return BatchAck(batch_id=intake.batch_id, duplicate=True)
        return BatchAck(
            batch_id=intake.batch_id,
            duplicate=False,
            fragments=intake.opened,
            invalid=intake.invalid,
        )

    def config(self) -> SignedConfig:
        """``GET /v1/config``."""
        return signed_config(self.settings, self.keys, int(self.clock()))

    def channels(self) -> ChannelList:
        """``GET /v1/channels``: every configured channel and the epochs received."""
        spans = self.store.epoch_spans()
        return ChannelList(
            channels=[
                ChannelSummary(**c.model_dump(), epochs=spans.get(c.id))
                for c in self.settings.channels
            ]
        )

    def estimate(
        self,
        channel_id: str,
        epoch: int | None = None,
        epoch_from: int | None = None,
        epoch_to: int | None = None,
        top: int | None = None,
    ) -> ReleaseBody:
        """``GET /v1/channels/{id}/estimate``: a release over the range the request means."""
        first, last = self.releases.epochs(channel_id, epoch, epoch_from, epoch_to)
        release = self.releases.release(channel_id, first, last)
        if top is None and release.estimate.values.size > DEFAULT_TOP:
            top = DEFAULT_TOP
        return release.to_wire(top)

    def privacy(self, channel_id: str) -> Ledger:
        """``GET /v1/channels/{id}/privacy``."""
        return self.ledger.ledger(channel_id)

    def overview(self) -> list[ChannelView]:
        """What the dashboard shows: every channel's latest release and its ledger."""
        views = []
        for config in self.settings.channels:
            summary = self.store.latest_summary(config.id)
            ledger = [] if summary is None else self.ledger.rows(config.id)
            views.append(ChannelView(config, summary, ledger))
        return views
