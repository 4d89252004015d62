"""Releases: estimates over a range of epochs with standard errors, 95% intervals and the
certified central (ε, δ) computed from the crowds actually received.

How a release over the received crowds is certified is the mechanism's own
(:meth:`common.mechanisms.Mechanism.certify`, MECHANISMS.md): histogram mechanisms certify at
the smallest shuffled batch and compose epochs, report fragments use the across-batches bound,
longitudinal channels certify at the smallest level crowd. The add/remove statement including
randomized deletion is ESA-revisited Theorem V.1 (:meth:`ReleaseCertificate.with_deletion`).
A release is post-processing of epochs the ledger already charged (:mod:`analyzer.ledger`):
computing one (``GET .../estimate``) writes nothing; publishing one (``POST .../releases``,
:meth:`ReleaseService.publish`) records it with the summary the dashboard draws.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from analyzer.channels import ChannelRuntime
from analyzer.errors import IncompleteBatchesError, NothingReceivedError, UnknownChannelError
from analyzer.metrics import Events
from analyzer.store import AnalyzerStore, BatchProgress, CrowdCheck, ReceivedRange
from common.accounting import BoundResult
from common.mechanisms import Estimate, LocalPrivacy, NoDataError
from common.mechanisms._estimates import FloatArray, IntArray
from common.wire import Bound, CrowdCheckBody, LocalBound, ReleaseBody

#: Bins kept in a histogram release's stored summary (the dashboard draws the top 20).
SUMMARY_BINS = 50
#: Bins returned by default for large histograms (``?top=N`` asks for more).
DEFAULT_TOP = 10_000


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
        return "; ".join(n for n in notes if n)

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


def _at(values: FloatArray | None, index: IntArray) -> list[float] | None:
    return None if values is None else [float(values[i]) for i in index]


class ReleaseService:
    """Computes releases from the store (a read) and records the ones published."""

    def __init__(
        self, store: AnalyzerStore, channels: Mapping[str, ChannelRuntime], events: Events
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
        self.runtime(channel_id)
        if epoch is not None:
            return epoch, epoch
        if epoch_from is not None and epoch_to is not None:
            return epoch_from, epoch_to
        span = self.store.epoch_spans().get(channel_id)
        if span is None:
            raise NothingReceivedError(f"no batch received for {channel_id!r} yet")
        last = span[1]
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

        Only complete batches count (every part received and opened); the others in
        range are left out and named in the release's note.

        Raises:
            UnknownChannelError: if the channel is not configured.
            IncompleteBatchesError: if the range holds batches but none is complete yet.
            NothingReceivedError: if no usable batch was received in the range.
        """
        runtime = self.runtime(channel_id)
        received = self.store.received(channel_id, crowd_id, epoch_from, epoch_to)
        incomplete = self.store.incomplete(channel_id, crowd_id, epoch_from, epoch_to)
        check = self.store.crowd_check(channel_id, crowd_id, epoch_from, epoch_to)
        span = f"{channel_id!r} in epochs [{epoch_from}, {epoch_to}]"
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
        return replace(release, incomplete=incomplete, crowd_check=check)

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
        estimate=runtime.estimate(merged),
        certificate=certs.certified,
        other_notion=certs.other,
        crowds=certs.crowds,
        add_remove=certs.with_deletion(config.eps_cr, config.delta_cr),
        lower=certs.lower,
        local=runtime.local_privacy(),
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
