"""Releases: estimates over a range of epochs with standard errors, 95% intervals and the
certified central (ε, δ) computed from the crowds actually received.

How a release over the received crowds is certified is the mechanism's own
(:meth:`common.mechanisms.Mechanism.certify`, docs/mechanisms.md): histogram mechanisms certify at
the smallest shuffled batch and compose epochs, report fragments use the across-batches bound,
longitudinal channels certify at the smallest level crowd. The add/remove statement including
randomized deletion is ESA-revisited Theorem V.1 (:meth:`ReleaseCertificate.with_deletion`).
A release is post-processing of epochs the ledger already charged (:mod:`analyzer.ledger`):
computing one (``GET .../estimate``) writes nothing; publishing one (``POST .../releases``,
:meth:`ReleaseService.publish`) records it with the summary the dashboard draws.

A release reads only settled epochs (:func:`settle`): those every shuffler serving the channel
has delivered its batch for, and those :class:`EpochCloser` closed at their timeout (with the
batches complete then). So a release changes by whole epochs, never by one shuffler's batch,
and a lone lying shuffler that pads a target's report with its own fragments finds it mixed
with the other shufflers' crowds of the epoch (docs/protocol-notes.md, "Releases wait for
every shuffler").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from analyzer.channels import ChannelRuntime
from analyzer.errors import (
    EpochsOpenError,
    IncompleteBatchesError,
    NothingReceivedError,
    UnknownChannelError,
)
from analyzer.metrics import AnalyzerEvents
from analyzer.records import BatchProgress, CrowdCheck, DeliveredBatch, Group, ReceivedRange
from analyzer.store import AnalyzerStore
from common.accounting import BoundResult
from common.mechanisms import Estimate, LocalPrivacy, NoDataError
from common.mechanisms._estimates import FloatArray, IntArray
from common.wire import Bound, CrowdCheckBody, LocalBound, ReleaseBody

#: Bins kept in a histogram release's stored summary (the dashboard draws the top 20).
SUMMARY_BINS = 50
#: Bins returned by default for large histograms (``?top=N`` asks for more).
DEFAULT_TOP = 10_000

log = logging.getLogger("esa.analyzer")


@dataclass(frozen=True)
class Settled:
    """Which batches of a range a release may read: ``batches`` as (epoch, shuffler) of
    settled epochs; ``waiting`` the epochs not settled yet (epoch → shufflers delivered so
    far); ``late`` the batches completed after their epoch was closed (never released);
    ``check`` the crowd check over ``batches``."""

    batches: frozenset[tuple[int, str]]
    waiting: Mapping[int, int]
    late: tuple[tuple[int, str], ...]
    check: CrowdCheck


def settle(
    serving: Collection[str],
    delivered: Sequence[DeliveredBatch],
    closures: Mapping[int, frozenset[str]],
) -> Settled:
    """The settled part of a range: an epoch is settled when every shuffler of ``serving``
    delivered a batch (withheld ones count: the shuffler spoke) or it was closed at its
    timeout (``closures``: the shufflers whose batches it rests on). Each shuffler sends at
    most one batch per group, so a settled epoch never changes again."""
    by_epoch: dict[int, set[str]] = {}
    for batch in delivered:
        by_epoch.setdefault(batch.epoch, set()).add(batch.shuffler_id)
    kept: dict[int, frozenset[str]] = dict(closures)
    for epoch, shufflers in by_epoch.items():
        if epoch not in kept and shufflers >= set(serving):
            kept[epoch] = frozenset(shufflers)
    keys = frozenset(
        (b.epoch, b.shuffler_id) for b in delivered if b.shuffler_id in kept.get(b.epoch, ())
    )
    in_range = [b for b in delivered if (b.epoch, b.shuffler_id) in keys]
    return Settled(
        batches=keys,
        waiting={e: len(s) for e, s in sorted(by_epoch.items()) if e not in kept},
        late=tuple(
            sorted(
                (b.epoch, b.shuffler_id)
                for b in delivered
                if b.epoch in kept and (b.epoch, b.shuffler_id) not in keys
            )
        ),
        check=CrowdCheck(
            batches=len(in_range),
            claimed=sum(b.claimed for b in in_range),
            verified=sum(b.verified for b in in_range),
            invalid=sum(b.invalid for b in in_range),
            short=sum(b.verified < b.claimed for b in in_range),
            withheld=sum(b.withheld for b in in_range),
        ),
    )


def settled_received(
    store: AnalyzerStore, runtime: ChannelRuntime, crowd_id: str, epoch_from: int, epoch_to: int
) -> tuple[Settled, ReceivedRange]:
    """What of ``[from, to]`` anything public may be computed from (:func:`settle`) and the
    accumulators of those batches only."""
    span = (runtime.config.id, crowd_id, epoch_from, epoch_to)
    settled = settle(runtime.shuffler_ids, store.delivered(*span), store.closures(*span))
    return settled, _only(store.received(*span), settled.batches)


def _only(received: ReceivedRange, keys: frozenset[tuple[int, str]]) -> ReceivedRange:
    """``received`` restricted to the (epoch, shuffler) batches of ``keys``."""
    return ReceivedRange(
        [s for s in received.states if (s.epoch, s.shuffler_id) in keys],
        {k: sizes for k, sizes in received.batch_sizes.items() if k in keys},
    )


@dataclass(frozen=True)
class Release:
    """An estimate over ``[epoch_from, epoch_to]`` with its certificate."""

    channel_id: str
    epoch_from: int
    epoch_to: int
    estimate: Estimate
    certificate: BoundResult
    other_notion: BoundResult | None
    crowds: dict[str, int]
    add_remove: BoundResult | None = None
    lower: BoundResult | None = None
    local: LocalPrivacy | None = None
    #: Batches in range left out because parts are missing, unopened or quarantined: id →
    #: (opened, parts, quarantined).
    incomplete: Mapping[str, BatchProgress] = field(default_factory=dict)
    #: Claimed against verified crowds of the batches the release rests on.
    crowd_check: CrowdCheck | None = None
    #: Epochs in range left out because they are not settled yet: epoch → shufflers delivered.
    waiting: Mapping[int, int] = field(default_factory=dict)
    #: (epoch, shuffler) batches left out because they completed after their epoch closed.
    late: tuple[tuple[int, str], ...] = ()

    @property
    def note(self) -> str:
        """The estimate's note, batches certified below their claimed crowd, and which
        batches were left out."""
        notes = [self.estimate.note]
        check = self.crowd_check
        if check is not None and check.short:
            notes.append(
                f"{check.short} batch(es) certified at the crowd their fragments verify, not "
                f"the crowd claimed ({check.verified:,} of {check.claimed:,} contributions; "
                f"{check.invalid:,} fragments failed to open or parse)"
                + (f", {check.withheld} of them withheld below min_crowd" if check.withheld else "")
            )
        if self.incomplete:
            left_out = ", ".join(
                f"{batch_id} ({p.opened}/{p.parts} parts"
                + (
                    f", {p.quarantined} quarantined after failed openings)"
                    if p.quarantined
                    else ")"
                )
                for batch_id, p in sorted(self.incomplete.items())
            )
            notes.append(
                f"left out {len(self.incomplete)} incomplete batch(es) whose parts are not all "
                f"received and opened yet: {left_out}"
            )
        return "; ".join(n for n in [*notes, *self._unsettled()] if n)

    def _unsettled(self) -> list[str]:
        """The epochs left out until every shuffler delivered or their timeout, and the
        batches that arrived after their epoch closed."""
        notes = []
        if self.waiting:
            epochs = ", ".join(f"{e} ({n} delivered)" for e, n in sorted(self.waiting.items()))
            notes.append(
                f"left out {len(self.waiting)} epoch(s) still waiting for every shuffler's batch "
                f"or their close timeout: {epochs}"
            )
        return notes + _late_notes(self.late)

    def to_wire(self, top: int | None = None) -> ReleaseBody:
        """The release as clients see it (``top`` keeps the largest estimates, largest first)."""
        lo, hi = self.estimate.interval()
        index = self.estimate.top(top) if top else np.arange(self.estimate.values.size)
        return ReleaseBody(
            channel_id=self.channel_id,
            epochs=(self.epoch_from, self.epoch_to),
            n=self.estimate.n,
            bins=[int(i) for i in index],
            values=[float(self.estimate.values[i]) for i in index],
            std_errors=[float(self.estimate.std_errors[i]) for i in index],
            ci95=[(float(lo[i]), float(hi[i])) for i in index],
            note=self.note,
            certificate=_bound(self.certificate),
            other_notion=_optional(self.other_notion),
            with_randomized_deletion=_optional(self.add_remove),
            lower_bound=_optional(self.lower),
            local=None if self.local is None else _local(self.local),
            crowds=self.crowds,
            crowd_check=None if self.crowd_check is None else _crowd_check(self.crowd_check),
            truncated_values=_at(self.estimate.truncated, index),
        )


def _late_notes(late: Sequence[tuple[int, str]]) -> list[str]:
    """The note on batches complete after their epoch closed (never released)."""
    if not late:
        return []
    batches = ", ".join(f"epoch {e} from {s}" for e, s in late)
    return [f"left out {len(late)} batch(es) complete after the epoch closed: {batches}"]


def _at(values: FloatArray | None, index: IntArray) -> list[float] | None:
    return None if values is None else [float(values[i]) for i in index]


class ReleaseService:
    """Computes releases from the store (a read) and records the ones published."""

    def __init__(
        self, store: AnalyzerStore, channels: Mapping[str, ChannelRuntime], events: AnalyzerEvents
    ) -> None:
        self.store = store
        self.channels = channels
        self.events = events

    def epochs(
        self,
        channel_id: str,
        epoch: int | None = None,
        epoch_from: int | None = None,
        epoch_to: int | None = None,
    ) -> tuple[int, int]:
        """The range a request means: ``epoch`` alone, or missing ends at the last epoch
        received.

        Raises:
            UnknownChannelError: if the channel is not configured.
            NothingReceivedError: if an end is missing and nothing was received yet.
        """
        runtime = self.runtime(channel_id)
        if epoch is not None:
            return epoch, epoch
        if epoch_from is not None and epoch_to is not None:
            return epoch_from, epoch_to
        span = self.store.epoch_spans().get(channel_id)
        if span is None:
            raise NothingReceivedError(f"no batch received for {channel_id!r} yet")
        settled, _ = settled_received(self.store, runtime, "", *span)
        last = max((e for e, _ in settled.batches), default=span[1])
        return (last if epoch_from is None else epoch_from, last if epoch_to is None else epoch_to)

    def runtime(self, channel_id: str) -> ChannelRuntime:
        """The configured channel (UnknownChannelError otherwise)."""
        runtime = self.channels.get(channel_id)
        if runtime is None:
            raise UnknownChannelError(f"channel {channel_id!r} is not configured")
        return runtime

    def release(
        self, channel_id: str, epoch_from: int, epoch_to: int, crowd_id: str = ""
    ) -> Release:
        """Estimate over the epochs with its certificate (writes nothing).

        Only settled epochs count (every serving shuffler delivered, or closed at their
        timeout: :func:`settle`) and in them only complete batches (every part received and
        opened); the others in range are left out and named in the release's note.

        Raises:
            UnknownChannelError: if the channel is not configured.
            EpochsOpenError: if the range holds batches but no settled epoch yet.
            IncompleteBatchesError: if the range holds batches but none is complete yet.
            NothingReceivedError: if no usable batch was received in the range.
        """
        runtime = self.runtime(channel_id)
        settled, received = settled_received(self.store, runtime, crowd_id, epoch_from, epoch_to)
        incomplete = self.store.incomplete(channel_id, crowd_id, epoch_from, epoch_to)
        check = settled.check
        span = f"{channel_id!r} in epochs [{epoch_from}, {epoch_to}]"
        if not received.states and settled.waiting:
            raise EpochsOpenError(
                f"no settled epoch for {span} yet: {len(settled.waiting)} epoch(s) wait for "
                f"the batches of all {len(runtime.shuffler_ids)} shufflers serving the channel "
                "or for their close timeout (delivered so far: "
                + ", ".join(f"epoch {e}: {n}" for e, n in settled.waiting.items())
                + ")"
            )
        if not received.states and settled.late:
            raise NothingReceivedError(
                f"no batch of {span} can be released: " + "; ".join(_late_notes(settled.late))
            )
        if not received.states and incomplete:
            raise IncompleteBatchesError(
                f"no complete batch for {span} yet: {len(incomplete)} batch(es) still have "
                "parts missing or unopened"
            )
        if not received.states and check.withheld:
            raise NothingReceivedError(
                f"no batch of {span} can be released: the fragments of its {check.batches} "
                f"batch(es) verify {check.verified:,} of the {check.claimed:,} contributions "
                f"claimed ({check.invalid:,} failed to open or parse), fewer than "
                f"min_crowd={runtime.config.min_crowd} per batch"
            )
        if not received.states:
            raise NothingReceivedError(f"no batch received for {span}")
        release = _computed(runtime, received, epoch_from, epoch_to)
        return replace(
            release,
            incomplete=incomplete,
            crowd_check=check,
            waiting=settled.waiting,
            late=settled.late,
        )

    def publish(
        self, channel_id: str, epoch_from: int, epoch_to: int, crowd_id: str = ""
    ) -> Release:
        """Compute the release and record what was published (its summary and certificates).

        Raises:
            UnknownChannelError: if the channel is not configured.
            NothingReceivedError: if no usable batch was received in the range.
        """
        release = self.release(channel_id, epoch_from, epoch_to, crowd_id)
        display = self.runtime(channel_id).config.display
        summary_bins = None if display in ("series", "image") else SUMMARY_BINS
        self.store.add_release(release.to_wire(summary_bins), _optional(release.other_notion))
        self.events.count("releases")
        return release


class EpochCloser:
    """Closes each (channel, crowd, epoch) group for good ``close_seconds`` after its epoch's
    end (:meth:`AnalyzerStore.close_group`), so an epoch some shuffler never delivers for (a
    group it held below ``min_crowd``, no contributions, an outage, a stall) is released with
    the batches complete then, and a batch completing later never changes its releases. A
    group waits while a batch of it is being delivered (a part within ``close_seconds``) or
    opened."""

    def __init__(
        self,
        store: AnalyzerStore,
        channels: Mapping[str, ChannelRuntime],
        close_seconds: float,
        events: AnalyzerEvents,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.channels = channels
        self.close_seconds = close_seconds
        self.events = events
        self.clock = clock

    def due(self, group: Group, timeouts: int = 1) -> bool:
        """Whether ``timeouts`` close timeouts have passed since ``group``'s epoch ended (never
        for an unknown channel)."""
        runtime = self.channels.get(group.channel_id)
        if runtime is None:
            return False
        end = (group.epoch + 1) * runtime.config.epoch_seconds
        return self.clock() >= end + timeouts * self.close_seconds

    def close_until(self, channel_id: str, epoch: int) -> dict[Group, frozenset[str]]:
        """Close every open group of ``channel_id`` up to ``epoch`` now (an operator's call,
        as the timeout would): each closed group → the shufflers its releases rest on. Groups
        with a part waiting for the opener, or one arriving right now, stay open."""
        closed = {}
        for group in self.store.open_groups(self.clock() - self.close_seconds):
            if group.channel_id == channel_id and group.epoch <= epoch:
                shufflers = self.store.close_group(group)
                if shufflers is not None:
                    closed[group] = shufflers
        return closed

    def close_due(self) -> int:
        """Close every open group whose timeout has passed; how many this call closed. A batch
        still arriving holds its group open past the timeout, but for one timeout from the
        group's first incomplete part at most: a shuffler delivering late (after an outage)
        completes its batch, one trickling its parts cannot keep an epoch out of every release."""
        now, closed = self.clock(), 0
        held = set(self.store.open_groups(now - self.close_seconds))
        overdue = set(self.store.open_groups(now + HELD_FOREVER)) - held
        first = self.store.first_arrivals()
        due = [g for g in held if self.due(g)] + [
            g for g in overdue if self.due(g) and now >= first.get(g, now) + self.close_seconds
        ]
        for group in sorted(due):
            if self.store.close_group(group) is not None:
                closed += 1
        if closed:
            self.events.count("epochs_closed", closed)
            log.info("epochs closed at their timeout", extra={"groups": closed})
        return closed


#: Past any part's arrival time: :meth:`AnalyzerStore.open_groups` then leaves out no group for
#: a batch still arriving.
HELD_FOREVER = 10.0 * 365 * 86400


def _computed(
    runtime: ChannelRuntime, received: ReceivedRange, epoch_from: int, epoch_to: int
) -> Release:
    config = runtime.config
    crowds = runtime.crowds(received)
    merged = crowds[0].accumulator
    for item in crowds[1:]:
        merged = merged.merge(item.accumulator)
    try:
        certs = runtime.certify(crowds)
    except NoDataError as error:
        raise NothingReceivedError(f"{config.id!r}: {error}") from error
    return Release(
        channel_id=config.id,
        epoch_from=epoch_from,
        epoch_to=epoch_to,
        estimate=runtime.mechanism.estimate(merged),
        certificate=certs.certified,
        other_notion=certs.other,
        crowds=certs.crowds,
        add_remove=certs.with_deletion(config.eps_cr, config.delta_cr),
        lower=certs.lower,
        local=runtime.mechanism.local_privacy(),
    )


def _bound(result: BoundResult) -> Bound:
    return Bound.model_validate(result.as_dict())


def _optional(result: BoundResult | None) -> Bound | None:
    return None if result is None else _bound(result)


def _crowd_check(check: CrowdCheck) -> CrowdCheckBody:
    return CrowdCheckBody(
        batches=check.batches,
        claimed=check.claimed,
        verified=check.verified,
        invalid_fragments=check.invalid,
        short_batches=check.short,
        withheld_batches=check.withheld,
    )


def _local(local: LocalPrivacy) -> LocalBound:
    return LocalBound(
        removal=local.removal,
        replacement=local.replacement,
        eps_l_inf=local.eps_l_inf,
        eps_l1=local.eps_l1,
        note=local.note,
    )
