"""The analyzer as one object: what the HTTP routes call, built from settings.

It wires intake, the background part opener, releases and the ledger over one
:class:`~analyzer.store.AnalyzerStore` and answers in :mod:`common.wire` models; every refusal
is an :class:`~analyzer.errors.AnalyzerError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from analyzer.catalog import ChannelCatalog
from analyzer.config import AnalyzerKeys, check_key_timing, signed_config
from analyzer.dashboard import DASHBOARD_EPOCHS, ChannelView
from analyzer.descriptors import ShufflerDescriptors
from analyzer.errors import NothingReceivedError
from analyzer.intake import BatchIntake, IntakePolicy
from analyzer.ledger import LedgerService
from analyzer.metrics import AnalyzerEvents
from analyzer.opening import FragmentOpener, PartOpener
from analyzer.releases import DEFAULT_TOP, SUMMARY_BINS, EpochCloser, Release, ReleaseService
from analyzer.settings import AnalyzerSettings
from analyzer.store import AnalyzerStore
from analyzer.training import Trainer, published_channels
from common.collection import ANALYZER_KEY_FILE
from common.envelope import public_bytes
from common.wire import (
    BatchAck,
    ChannelChange,
    ChannelConfig,
    ChannelList,
    ChannelSummary,
    ClosedGroup,
    EpochCloseRequest,
    EpochsClosed,
    Ledger,
    PrivacyOverview,
    ReleaseBody,
    ReleaseRequest,
    SignedConfig,
    b64,
)
from runtime import db
from runtime.failpoints import failpoint
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
    events: AnalyzerEvents
    opener: PartOpener
    descriptors: ShufflerDescriptors
    catalog: ChannelCatalog
    clock: Callable[[], float] = time.time
    trainer: Trainer | None = None
    closer: EpochCloser | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def from_settings(
        cls, settings: AnalyzerSettings, clock: Callable[[], float] = time.time
    ) -> AnalyzerService:
        """Load keys, validate channels and open the database named by ``settings``.

        Raises:
            InvalidChannelError: if a configured channel does not validate.
        """
        store = AnalyzerStore(db.make_engine(settings.database_url), clock)
        shuffler_ids = [s.id for s in settings.shufflers]
        catalog = ChannelCatalog(
            settings.channels,
            shuffler_ids,
            store,
            clock,
            settings.part_cap,
            lambda channels: check_key_timing(settings, channels),
        )
        channels = catalog.table
        # A retired HPKE key stays loaded while parts stored before it retired wait to be
        # opened (never one an admin retired early: a compromised key).
        keys = AnalyzerKeys.load(
            settings, clock, lambda: catalog.table.configs(), store.oldest_unopened_at
        )
        deadline = settings.descriptor_fetch_deadline_seconds
        entries = settings.shufflers
        descriptors = ShufflerDescriptors(entries, store, clock, deadline_seconds=deadline)
        policy = IntakePolicy(
            ring=keys.ring,
            channels=channels,
            shufflers=descriptors.signers,
            max_batch_bytes=settings.part_cap,
            refresh_channels=catalog.refresh,
            renew_signer=descriptors.renew_signer,
            clock=clock,
            epoch_skew_seconds=settings.epoch_skew_seconds,
        )
        events = AnalyzerEvents()
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
            ),
            descriptors,
            catalog,
            clock,
            Trainer(store, channels, settings.training_dir),
            closer=EpochCloser(store, channels, settings.epoch_close_seconds, events, clock),
        )

    def start(self) -> None:
        """Wait for the database and upgrade its schema (the pre-start step), then start
        opening stored parts (first the ones stored before a crash)."""
        db.wait_for(self.store.engine)
        db.upgrade(self.store.engine, MIGRATIONS)
        self.catalog.refresh()
        charged = self.ledger.charge_missing()
        self.descriptors.seed()
        processes = self.opener.opener.warm()
        self.opener.start(self.settings.opening_poll_seconds)
        self.descriptors.start(self.settings.descriptor_refresh_seconds)
        self.keys.start()
        if self.settings.publish_dir is not None:
            key = b64(public_bytes(self.keys.signing.public_key())) + "\n"
            publish(self.settings.publish_dir, ANALYZER_KEY_FILE, key)
        threading.Thread(target=self._retain, name="esa-retention", daemon=True).start()
        threading.Thread(target=self._follow, name="esa-channels", daemon=True).start()
        threading.Thread(target=self._close_epochs, name="esa-epoch-close", daemon=True).start()
        log.info(
            "analyzer ready",
            extra={
                "opening_processes": processes,
                "channels": list(self.catalog.table),
                "shufflers": [s.id for s in self.settings.shufflers],
                "epochs_charged": charged,
            },
        )

    def _follow(self) -> None:
        """Fold in channel changes other replicas made (a change made here is folded at once)."""
        while not self.stopping.wait(self.settings.channel_refresh_seconds):
            try:
                self.catalog.refresh()
            except Exception:  # the thread must survive a database outage
                log.exception("reading the channel log failed; retried")

    def _close_epochs(self) -> None:
        """Close the groups whose close timeout passed (:class:`EpochCloser`)."""
        closer = self.closer
        if closer is None:
            return
        while not self.stopping.wait(self.settings.epoch_close_poll_seconds):
            try:
                closer.close_due()
            except Exception:  # the database, mostly: the next round tries again
                log.exception("closing epochs at their timeout failed; retried")

    def close(self) -> None:
        """Stop the opener, the descriptor fetches and retention, release the database."""
        self.stopping.set()
        self.keys.stop()
        self.descriptors.stop()
        self.opener.stop()
        self.store.engine.dispose()

    def accept(self, body: bytes, signature: str | None, shuffler_id: str | None) -> BatchAck:
        """``POST /v1/batches``: store the part (:meth:`BatchIntake.accept`) and answer right
        after the commit; fragment counts are unknown until the opener has opened it."""
        intake = self.intake.accept(body, signature, shuffler_id)
        if not intake.duplicate:
            failpoint("analyzer.intake.after_part_committed")
        self.opener.wake()
        return BatchAck(batch_id=intake.batch_id, part=intake.part, duplicate=intake.duplicate)

    def _retain(self) -> None:
        while not self.stopping.wait(RETENTION_INTERVAL):
            try:
                self.purge_incomplete()
            except Exception:  # the database, mostly: retention tries again next round
                log.exception("retention of incomplete batches failed; retrying")

    def purge_incomplete(self) -> int:
        """Delete what remains of batches that can no longer complete, and the seal keys of
        the epochs that received nothing for as long (retention)."""
        before = self.clock() - self.settings.incomplete_retention_seconds
        purged = self.store.purge_incomplete(before)
        if purged:
            self.events.count("parts_purged_incomplete", purged)
            log.warning("retention deleted parts of batches that never completed")
        self.store.forget_fragments(before)
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
        self.catalog.refresh()
        revision, published = self.catalog.table.published()
        if self.trainer is not None and self.trainer.channels:
            published = published_channels(published, self.trainer.models())
        now = int(self.clock())
        return signed_config(self.settings, self.keys, now, shufflers, published, revision)

    def channels(self) -> ChannelList:
        """``GET /v1/channels``: every channel (retired ones too) and the epochs received."""
        spans = self.store.epoch_spans()
        self.catalog.refresh()
        return ChannelList(
            channels=[
                ChannelSummary(**c.model_dump(), epochs=spans.get(c.id))
                for c in self.catalog.table.configs()
            ],
            revision=self.catalog.revision,
        )

    def add_channel(self, config: ChannelConfig) -> ChannelChange:
        """``POST /v1/admin/channels``: add a channel while running (the same one again: no
        change; another with its id: refused)."""
        channel, changed = self.catalog.add(config)
        return ChannelChange(channel=channel, revision=self.catalog.revision, changed=changed)

    def retire_channel(self, channel_id: str) -> ChannelChange:
        """``POST /v1/admin/channels/{id}/retire``: no contributions from its next epoch on."""
        channel, changed = self.catalog.retire(channel_id)
        return ChannelChange(channel=channel, revision=self.catalog.revision, changed=changed)

    def close_epochs(self, channel_id: str, request: EpochCloseRequest) -> EpochsClosed:
        """``POST /v1/admin/channels/{id}/close``: close the channel's open groups up to
        ``request.epoch`` now (:meth:`EpochCloser.close_until`).

        Raises:
            UnknownChannelError: the channel is not configured.
        """
        self.releases.runtime(channel_id)
        closer = self.closer or EpochCloser(
            self.store, self.releases.channels, self.settings.epoch_close_seconds, self.events
        )
        closed = closer.close_until(channel_id, request.epoch)
        if closed:
            log.info(
                "epochs closed by an admin", extra={"channel": channel_id, "groups": len(closed)}
            )
        return EpochsClosed(
            channel_id=channel_id,
            epoch=request.epoch,
            closed=[
                ClosedGroup(epoch=g.epoch, crowd_id=g.crowd_id, shufflers=sorted(s))
                for g, s in sorted(closed.items())
            ],
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
        over its last epoch), its ledger and its health."""
        views = []
        spans = self.store.epoch_spans()
        health = self.store.channel_health(DASHBOARD_EPOCHS)
        self.catalog.refresh()
        for config in self.catalog.table.configs():
            summary = self.store.latest_summary(config.id)
            if summary is None and config.id in spans:
                summary = self._latest(config.id)
            ledger = None if summary is None else self.ledger.ledger(config.id)
            rows = [row for row in health if row.channel_id == config.id]
            views.append(ChannelView(config, summary, ledger, rows))
        return views

    def _latest(self, channel_id: str) -> ReleaseBody | None:
        """A read over the channel's last settled epoch (None: nothing releasable yet)."""
        try:
            first, last = self.releases.epochs(channel_id)
            return self.releases.release(channel_id, first, last).to_wire(SUMMARY_BINS)
        except NothingReceivedError:
            return None


def _wire(release: Release, top: int | None) -> ReleaseBody:
    if top is None and release.estimate.values.size > DEFAULT_TOP:
        top = DEFAULT_TOP
    return release.to_wire(top)
