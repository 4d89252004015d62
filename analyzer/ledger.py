"""The privacy ledger: loss charged once per (channel, epoch), and a device's lifetime ε.

The analyzer's view of an epoch is the shuffled batches it received, so an epoch is charged
once, at the crowds received, when its batches come in (:meth:`ChannelRuntime.charge`, written
with every batch by :mod:`analyzer.intake`). Estimates and published releases are
post-processing of that view and cost nothing more (post-processing, Dwork & Roth, *The
Algorithmic Foundations of Differential Privacy*, Proposition 2.1).

A device that took part in every epoch loses the adaptive composition of the epochs' views.
Each epoch enters as its (ε, δ) certificate (the worst crowd of the epoch), as the PLD of the
pair dominating every (ε, δ)-DP mechanism (Kairouz, Oh, Viswanath 2015; dp_accounting's
``from_privacy_parameters``), composed with Google's ``dp_accounting`` PLD (pessimistic
estimates, :func:`common.accounting.lifetime.compose_epochs`) beside basic composition
(Dwork & Roth, Theorem 3.16) and advanced composition, with the δ split shown.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import get_args

from analyzer.channels import ChannelRuntime
from analyzer.errors import UnknownChannelError
from analyzer.settings import LIFETIME_DELTA
from analyzer.store import AnalyzerStore, StoredCharge
from common.accounting.lifetime import Epoch, LifetimeResult, compose_epochs
from common.accounting.results import Neighbouring
from common.wire import (
    Bound,
    Ledger,
    LedgerRow,
    Lifetime,
    PrivacyOverview,
    PublishedRelease,
)

#: When the epochs' own δ add up to the lifetime δ or more, the composition is stated at this
#: multiple of their sum (compose_epochs needs δ left over for the composition itself).
DELTA_HEADROOM = 2.0
#: Distinct lists of epochs whose composition is kept (composition is the costly part).
CACHED_COMPOSITIONS = 256

NOTE = (
    "each epoch charged once at the crowds received (releases and estimates are "
    "post-processing); lifetime of a device in every epoch: dp_accounting PLD composition of "
    "the epochs' (ε, δ) certificates beside basic and advanced composition"
)


def row(charge: StoredCharge) -> LedgerRow:
    """A stored charge as a ledger row (``n``: the smallest crowd it relies on)."""
    record = json.loads(charge.certificate)
    crowds = {str(k): int(v) for k, v in record["crowds"].items()}
    return LedgerRow(
        epoch=charge.epoch,
        crowd_id=charge.crowd_id,
        n=min(crowds.values(), default=0),
        certificate=Bound.model_validate(record["certificate"]),
        other_notion=Bound.model_validate(record["other_notion"]),
        crowds=crowds,
        batches=charge.batches,
        charged_at=charge.charged_at,
    )


def worst_per_epoch(rows: Iterable[LedgerRow]) -> list[LedgerRow]:
    """One row per (channel) epoch: the crowd with the largest certified ε (a device sits in
    one crowd per epoch; charging the worst one covers every device)."""
    worst: dict[int, LedgerRow] = {}
    for item in rows:
        kept = worst.get(item.epoch)
        if kept is None or _worse(item.certificate, kept.certificate):
            worst[item.epoch] = item
    return [worst[e] for e in sorted(worst)]


def _worse(a: Bound, b: Bound) -> bool:
    return (a.eps, a.delta) > (b.eps, b.delta)


def _notion(name: str) -> Neighbouring:
    for notion in get_args(Neighbouring):
        if notion == name:
            return notion  # type: ignore[no-any-return]
    raise ValueError(f"unknown neighbouring notion, got neighbouring={name!r}")


def epoch_of(bound: Bound) -> Epoch:
    """One epoch as its (ε, δ) certificate (always valid: every (ε, δ)-DP view is dominated by
    the (ε, δ) pair of Kairouz–Oh–Viswanath 2015)."""
    return Epoch.from_certificate(bound.eps, bound.delta, _notion(bound.neighbouring), bound.method)


@lru_cache(maxsize=CACHED_COMPOSITIONS)
def _composed(epochs: tuple[Epoch, ...], delta: float) -> LifetimeResult:
    return compose_epochs(epochs, delta)


def lifetime(bounds: Sequence[Bound], delta: float = LIFETIME_DELTA) -> Lifetime | None:
    """Lifetime (ε, δ) of one device in every epoch of ``bounds`` (one bound per epoch, all in
    one neighbouring notion): :func:`common.accounting.lifetime.compose_epochs` (dp_accounting
    PLD, pessimistic) at total δ ``delta``, or at :data:`DELTA_HEADROOM` times the epochs' own
    δ when those exhaust ``delta`` (said in the note). None without epochs.

    Raises:
        ValueError: if the bounds mix neighbouring notions.
    """
    if not bounds:
        return None
    epochs = tuple(epoch_of(b) for b in bounds)
    spent = math.fsum(b.delta for b in bounds)
    total = delta if spent < delta else DELTA_HEADROOM * spent
    result = _composed(epochs, total)
    body = Lifetime.model_validate(result.as_dict())
    if total != delta:
        body.note += (
            f"; the epochs' own δ add up to {spent:.3g} >= the lifetime δ {delta:.3g}, so the "
            f"composition is stated at δ = {total:.3g}"
        )
    return body


def common_notion(rows: Sequence[LedgerRow]) -> list[Bound]:
    """Each epoch's bound in one notion: the certified one when all agree, otherwise the
    replacement statement every mechanism also gives (``other_notion``)."""
    if len({r.certificate.neighbouring for r in rows}) <= 1:
        return [r.certificate for r in rows]
    return [
        r.certificate if r.certificate.neighbouring == "replacement" else r.other_notion
        for r in rows
    ]


class LedgerService:
    """Reads the privacy ledger; charges epochs stored before the ledger existed."""

    def __init__(
        self,
        store: AnalyzerStore,
        channels: Mapping[str, ChannelRuntime],
        delta: float = LIFETIME_DELTA,
    ) -> None:
        self.store = store
        self.channels = channels
        self.delta = delta

    def charge_missing(self) -> int:
        """Charge every stored epoch without a ledger row (once, at start); returns how many."""
        missing = [m for m in self.store.uncharged() if m[0] in self.channels]
        for channel_id, crowd_id, epoch in missing:
            self.store.recharge(channel_id, crowd_id, epoch, self.channels[channel_id].charge)
        return len(missing)

    def rows(self, channel_id: str) -> list[LedgerRow]:
        """The charged epochs of a configured channel, worst crowd per epoch.

        Raises:
            UnknownChannelError: if the channel is not configured.
        """
        if channel_id not in self.channels:
            raise UnknownChannelError(f"channel {channel_id!r} is not configured")
        return worst_per_epoch(row(c) for c in self.store.charges(channel_id))

    def ledger(self, channel_id: str) -> Ledger:
        """``GET /v1/channels/{id}/privacy``."""
        rows = self.rows(channel_id)
        published = [
            PublishedRelease(
                id=r.id,
                epochs=(r.epoch_from, r.epoch_to),
                n=r.n,
                certificate=r.certificate,
                released_at=r.released_at,
            )
            for r in self.store.releases(channel_id)
        ]
        return Ledger(
            channel_id=channel_id,
            epochs=rows,
            lifetime=lifetime([r.certificate for r in rows], self.delta),
            releases=published,
            note=NOTE,
        )

    def overview(self) -> PrivacyOverview:
        """``GET /v1/privacy``: a device in every epoch of every configured channel."""
        rows = [r for channel_id in self.channels for r in self.rows(channel_id)]
        return PrivacyOverview(
            channels=list(self.channels),
            epochs=len(rows),
            lifetime=lifetime(common_notion(rows), self.delta),
            note=f"{len(rows)} epochs over {len(self.channels)} channels; {NOTE}",
        )
