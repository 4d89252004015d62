"""The analyzer as one object: what the HTTP routes call, built from settings.

It wires intake, the background part opener, releases and the ledger over one
:class:`~analyzer.store.AnalyzerStore` and answers in :mod:`common.wire` models; every refusal
is an :class:`~analyzer.errors.AnalyzerError`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from analyzer.channels import ChannelRuntime
from analyzer.config import AnalyzerKeys, signed_config
from analyzer.dashboard import ChannelView
from analyzer.descriptors import ShufflerDescriptors
from analyzer.errors import NothingReceivedError
from analyzer.intake import BatchIntake, IntakePolicy
from analyzer.ledger import LedgerService
from analyzer.metrics import Events
from analyzer.opening import FragmentOpener, PartOpener
from analyzer.releases import DEFAULT_TOP, SUMMARY_BINS, Release, ReleaseService
from analyzer.settings import AnalyzerSettings
from analyzer.store import AnalyzerStore
from analyzer.training import Trainer, published_channels
from common.collection import ANALYZER_KEY_FILE
from common.envelope import load_ed25519_public, public_bytes
from common.wire import (
    BatchAck,
    ChannelList,
    ChannelSummary,
    Ledger,
    PrivacyOverview,
    ReleaseBody,
    ReleaseRequest,
    SignedConfig,
    b64,
    unb64,
)
from runtime import db
from runtime.publish import publish

log = logging.getLogger("esa.analyzer")
MIGRATIONS = Path(__file__).parent / "migrations"
#: Seconds between retention rounds (retention itself is days).
RETENTION_INTERVAL = 600.0


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
    opener: PartOpener
    descriptors: ShufflerDescriptors
    clock: Callable[[], float] = time.time
    trainer: Trainer | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

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
            max_batch_bytes=settings.part_cap,
        )
        store = AnalyzerStore(db.make_engine(settings.database_url), clock)
        events = Events()
        return cls(
            settings,
            keys,
            store,
            BatchIntake(store, policy, events),
            ReleaseService(store, channels, events),
            LedgerService(store, channels, settings.lifetime_delta, settings.device_budget),
            events,
            PartOpener(
                store,
                channels,
                FragmentOpener(policy.ring, settings.opening_processes, settings.opening_chunk),
                events,
                settings.fault_while_opening,
            ),
            ShufflerDescriptors(settings.shufflers, store, clock),
            clock,
            Trainer(store, channels, settings.training_dir),
        )

    def start(self) -> None:
        """Wait for the database and upgrade its schema (the pre-start step), then start
        opening stored parts (first the ones stored before a crash)."""
        db.wait_for(self.store.engine)
        db.upgrade(self.store.engine, MIGRATIONS)
        charged = self.ledger.charge_missing()
        self.descriptors.seed()
        processes = self.opener.opener.warm()
        self.opener.start(self.settings.opening_poll_seconds)
        self.descriptors.start(self.settings.descriptor_refresh_seconds)
        if self.settings.publish_dir is not None:
            key = b64(public_bytes(self.keys.signing.public_key())) + "\n"
            publish(self.settings.publish_dir, ANALYZER_KEY_FILE, key)
        threading.Thread(target=self._retain, name="esa-retention", daemon=True).start()
        log.info(
            "analyzer ready",
            extra={
                "opening_processes": processes,
                "channels": [c.id for c in self.settings.channels],
                "shufflers": [s.id for s in self.settings.shufflers],
                "epochs_charged": charged,
            },
        )

    def close(self) -> None:
        """Stop the opener, the descriptor fetches and retention, release the database."""
        self.stopping.set()
        self.descriptors.stop()
        self.opener.stop()
        self.store.engine.dispose()

    def accept(self, body: bytes, signature: str | None, shuffler_id: str | None) -> BatchAck:
        """``POST /v1/batches``: store the part (:meth:`BatchIntake.accept`) and answer right
        after the commit; fragment counts are unknown until the opener has opened it."""
        intake = self.intake.accept(body, signature, shuffler_id)
        if self.settings.fault_after_commit == "exit" and not intake.duplicate:
            # Test-only crash window between the commit and the answer (refused in production).
            os._exit(3)
        self.opener.wake()
        return BatchAck(batch_id=intake.batch_id, part=intake.part, duplicate=intake.duplicate)

    def _retain(self) -> None:
        while not self.stopping.wait(RETENTION_INTERVAL):
            try:
                self.purge_incomplete()
            except Exception:  # the database, mostly: retention tries again next round
                log.exception("retention of incomplete batches failed; retrying")

    def purge_incomplete(self) -> int:
        """Delete what remains of batches that can no longer complete (retention)."""
        before = self.clock() - self.settings.incomplete_retention_seconds
        purged = self.store.purge_incomplete(before)
        if purged:
            self.events.count("parts_purged_incomplete", purged)
            log.warning("retention deleted parts of batches that never completed")
        return purged

    def requeue(self, batch_id: str | None = None) -> int:
        """Open quarantined parts again (admin, after fixing their cause); how many."""
        requeued = self.store.requeue_quarantined(batch_id)
        self.opener.wake()
        return requeued

    def config(self) -> SignedConfig:
        """``GET /v1/config``.

        Raises:
            ShufflersUnavailableError: a shuffler's signed descriptor is not known yet.
        """
        shufflers = self.descriptors.current()
        published = None
        if self.trainer is not None and self.trainer.channels:
            models = {c: self.trainer.state(c) for c in self.trainer.channels}
            published = published_channels(self.settings.channels, models)
        return signed_config(self.settings, self.keys, int(self.clock()), shufflers, published)

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
        """``GET /v1/channels/{id}/estimate``: a release over the range the request means (a
        read: nothing is written, nothing is charged)."""
        first, last = self.releases.epochs(channel_id, epoch, epoch_from, epoch_to)
        return _wire(self.releases.release(channel_id, first, last), top)

    def publish(self, channel_id: str, request: ReleaseRequest) -> ReleaseBody:
        """``POST /v1/channels/{id}/releases``: publish a release and record it (after
        :meth:`authorize`).

        Raises:
            UnknownChannelError, NothingReceivedError: as :meth:`estimate`.
        """
        first, last = self.releases.epochs(
            channel_id, request.epoch, request.epoch_from, request.epoch_to
        )
        return _wire(self.releases.publish(channel_id, first, last), request.top)

    def privacy(self, channel_id: str) -> Ledger:
        """``GET /v1/channels/{id}/privacy``."""
        return self.ledger.ledger(channel_id)

    def lifetime(self) -> PrivacyOverview:
        """``GET /v1/privacy``: lifetime ε of a device in every channel."""
        return self.ledger.overview()

    def overview(self) -> list[ChannelView]:
        """What the dashboard shows: every channel's latest published release (else a read
        over its last epoch) and its ledger."""
        views = []
        spans = self.store.epoch_spans()
        for config in self.settings.channels:
            summary = self.store.latest_summary(config.id)
            if summary is None and config.id in spans:
                summary = self._latest(config.id, spans[config.id][1])
            ledger = None if summary is None else self.ledger.ledger(config.id)
            views.append(ChannelView(config, summary, ledger))
        return views

    def _latest(self, channel_id: str, epoch: int) -> ReleaseBody | None:
        try:
            return self.releases.release(channel_id, epoch, epoch).to_wire(SUMMARY_BINS)
        except NothingReceivedError:
            return None


def _wire(release: Release, top: int | None) -> ReleaseBody:
    if top is None and release.estimate.values.size > DEFAULT_TOP:
        top = DEFAULT_TOP
    return release.to_wire(top)
