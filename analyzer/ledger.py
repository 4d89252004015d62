"""The privacy ledger: loss charged once per (channel, epoch), and a device's lifetime ε.

An epoch is charged once, at the crowds received, when its batches come in
(:meth:`ChannelRuntime.charge`); estimates and releases are post-processing of that view and
cost nothing more (Dwork & Roth, Proposition 2.1). A device's lifetime ε composes the epochs'
views with dp_accounting's PLD (:func:`common.accounting.lifetime.compose_epochs`), each epoch
entering as its mechanism's dominating pair (:meth:`common.mechanisms.Mechanism.epoch_pair`;
FMT21 Remark 3.5 eq. (20)) or else as its (ε, δ) certificate (Kairouz, Oh, Viswanath 2015),
beside basic (Dwork & Roth, Theorem 3.16) and advanced composition; the add/remove statement
adds randomized deletion's certificate (ESA-revisited Theorem V.1).

The argument in full, and the device budget shown: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Literal, get_args

from analyzer.channels import ChannelRuntime
from analyzer.errors import UnknownChannelError
from analyzer.records import StoredCharge
from analyzer.settings import LIFETIME_DELTA
from analyzer.store import AnalyzerStore
from common.accounting.lifetime import Epoch, LifetimeResult, charged_crowds, compose_epochs
from common.accounting.results import Neighbouring
from common.wire import (
    Bound,
    BudgetInUse,
    BudgetLimit,
    DeviceBudget,
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
#: Relative slack of the SDK's budget check (``encoder_client._state.BUDGET_SLACK``).
BUDGET_SLACK = 1e-9

NOTE = (
    "each epoch charged once at the crowds received (releases and estimates are "
    "post-processing); lifetime of a device in every epoch: dp_accounting PLD composition of "
    "each epoch's dominating pair at its crowd, or of its (ε, δ) certificate where the "
    "mechanism has no pair (composed_as), beside basic and advanced composition"
)

#: What the device budget of one channel's ledger counts.
CHANNEL_SCOPE = (
    "so far (the device-wide cap counts this channel's reports only here; GET /v1/privacy "
    "counts every channel)"
)

#: One charged epoch of one channel, as the ledger composes it.
Item = tuple[ChannelRuntime, LedgerRow]
ComposedAs = Literal["pair", "certificate"]


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


def _total_delta(epochs: Iterable[Epoch], delta: float) -> tuple[float, float]:
    """(δ the certificate parts spend, the total δ the composition is stated at)."""
    spent = math.fsum(c.delta for epoch in epochs for c in epoch.certificates)
    return spent, delta if spent < delta else DELTA_HEADROOM * spent


def compose_lifetime(epochs: Sequence[Epoch], delta: float = LIFETIME_DELTA) -> Lifetime | None:
    """The composition of ``epochs`` (one neighbouring notion) at total δ ``delta``, or at
    :data:`DELTA_HEADROOM` times the certificates' own δ when those exhaust ``delta`` (said in
    the note). None without epochs.

    Raises:
        ValueError: if the epochs mix neighbouring notions.
    """
    if not epochs:
        return None
    spent, total = _total_delta(epochs, delta)
    body = Lifetime.model_validate(_composed(tuple(epochs), total).as_dict())
    if total != delta:
        body.note += (
            f"; the epochs' own δ add up to {spent:.3g} >= the lifetime δ {delta:.3g}, so the "
            f"composition is stated at δ = {total:.3g}"
        )
    return body


def lifetime(bounds: Sequence[Bound], delta: float = LIFETIME_DELTA) -> Lifetime | None:
    """Lifetime (ε, δ) of one device in every epoch of ``bounds`` (one certificate per epoch,
    all in one neighbouring notion), composed as certificates (:func:`compose_lifetime`).

    Raises:
        ValueError: if the bounds mix neighbouring notions.
    """
    return compose_lifetime([epoch_of(b) for b in bounds], delta)


def common_notion(rows: Sequence[LedgerRow]) -> list[Bound]:
    """Each epoch's bound in one notion: the certified one when all agree, otherwise the
    replacement statement every mechanism also gives (``other_notion``)."""
    if len({r.certificate.neighbouring for r in rows}) <= 1:
        return [r.certificate for r in rows]
    return [_replacement(r) for r in rows]


def _replacement(item: LedgerRow) -> Bound:
    if item.certificate.neighbouring == "replacement":
        return item.certificate
    return item.other_notion


def _certificate_epoch(
    rt: ChannelRuntime, item: LedgerRow, deleted: bool, replacement: bool
) -> Epoch:
    """The epoch's certificate in the notion asked for (with deletion's count certificate)."""
    if not deleted and not replacement:
        return epoch_of(item.certificate)
    epoch = epoch_of(_replacement(item))
    return epoch.with_deletion(rt.config.eps_cr, rt.config.delta_cr) if deleted else epoch


def _epochs(
    items: Sequence[Item],
    crowds: Sequence[int],
    share: float,
    deleted: bool,
    replacement: bool,
) -> list[tuple[Epoch, ComposedAs]]:
    """Each epoch as its mechanism's dominating pair at its charged crowd, else its
    certificate; ``share`` is the δ of one epoch at which the pairs are compared."""
    out: list[tuple[Epoch, ComposedAs]] = []
    for (rt, item), n in zip(items, crowds, strict=True):
        deletion = (rt.config.eps_cr, rt.config.delta_cr) if deleted else None
        certificate = _certificate_epoch(rt, item, deleted, replacement)
        pair = None
        if item.n >= 1:
            pair = rt.mechanism.epoch_pair(n, share, deletion=deletion, replacement=replacement)
        # A pair stated in another notion than the epoch's certificate (an out-of-tree
        # mechanism's mistake) would not compose with the other epochs: keep the certificate.
        if pair is not None and pair.neighbouring == certificate.neighbouring:
            out.append((pair, "pair"))
        else:
            out.append((certificate, "certificate"))
    return out


def compose_items(
    items: Sequence[Item], delta: float, deleted: bool = False, replacement: bool = False
) -> tuple[Lifetime | None, list[ComposedAs]]:
    """The lifetime of a device in every epoch of ``items`` and how each epoch entered.

    Pair crowds are charged as :func:`~common.accounting.lifetime.charged_crowds` says and the
    pairs compared at ``(δ - δ of the certificate parts) / T`` per epoch: what
    ``esa account compose`` does (:func:`common.accounting.lifetime_for_mechanism`), so both
    give the same lifetime ε for the same crowds. ``deleted``: the add/remove statement with
    each channel's randomized deletion; ``replacement``: every epoch in the replacement notion.

    Raises:
        ValueError: if the epochs mix neighbouring notions.
    """
    if not items:
        return None, []
    count = len(items)
    crowds = charged_crowds([max(1, item.n) for _, item in items])
    built = _epochs(items, crowds, delta / count, deleted, replacement)
    spent, total = _total_delta((epoch for epoch, _ in built), delta)
    if (total - spent) / count != delta / count:
        built = _epochs(items, crowds, (total - spent) / count, deleted, replacement)
    body = compose_lifetime([epoch for epoch, _ in built], delta)
    used = [how for _, how in built]
    paired = [(items[i][1].n, crowds[i]) for i, how in enumerate(used) if how == "pair"]
    if body is not None and any(n != charged for n, charged in paired):
        exact, snapped = len({n for n, _ in paired}), len({c for _, c in paired})
        body.note += f"; {exact} distinct crowds charged at {snapped} (rounded down)"
    return body, used


def _window_peak(reports: Sequence[tuple[float, float]], seconds: int) -> float:
    """The most local ε charged by reports whose epochs start within one window: the SDK
    counts, at each report, the reports whose epoch started at or after ``start - seconds + 1``."""
    ordered = sorted(reports)
    peak, first = 0.0, 0
    for last, (start, _) in enumerate(ordered):
        while ordered[first][0] < start - seconds + 1:
            first += 1
        peak = max(peak, math.fsum(eps for _, eps in ordered[first : last + 1]))
    return peak


def _limits(
    scope: Literal["channel", "device"],
    budget: DeviceBudget | None,
    reports: Sequence[tuple[float, float]],
) -> list[BudgetLimit]:
    """The caps of one budget against ``reports`` ((epoch start, local ε) each)."""
    if budget is None:
        return []
    caps: list[tuple[Literal["lifetime", "window"], float, int | None, float]] = []
    if budget.lifetime_eps is not None:
        caps.append(("lifetime", budget.lifetime_eps, None, math.fsum(e for _, e in reports)))
    if budget.window_eps is not None and budget.window_seconds is not None:
        peak = _window_peak(reports, budget.window_seconds)
        caps.append(("window", budget.window_eps, budget.window_seconds, peak))
    return [
        BudgetLimit(
            scope=scope,
            span=span,
            eps=eps,
            window_seconds=seconds,
            spent=_finite(spent),
            left=max(0.0, eps - spent) if math.isfinite(spent) else 0.0,
            exhausted=spent > eps * (1.0 + BUDGET_SLACK),
        )
        for span, eps, seconds, spent in caps
    ]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _reports(items: Sequence[Item]) -> list[tuple[float, float]]:
    """(epoch start, local ε) of a device that reported in every epoch of ``items``: the
    SDK charges each report its local ε in the replacement notion at the epoch's start."""
    return [
        (float(item.epoch * rt.config.epoch_seconds), rt.mechanism.local_privacy().replacement)
        for rt, item in items
    ]


def budget_in_use(
    items: Sequence[Item],
    channel: DeviceBudget | None,
    device: DeviceBudget | None,
    scope: str,
) -> BudgetInUse:
    """What one device that reported in every epoch of ``items`` has spent of its local-ε
    budgets (``channel``: the channel's own, ``device``: the config's over all channels)."""
    reports = _reports(items)
    total = math.fsum(eps for _, eps in reports)
    largest = max((eps for _, eps in reports), default=0.0)
    limits = _limits("channel", channel, reports) + _limits("device", device, reports)
    note = (
        f"a device that reported in every one of the {len(reports)} epochs {scope}: each report "
        "charges its local ε (replacement notion), summed as the SDK does"
    )
    if not limits:
        note += "; the signed config sets no device budget here"
    if any(limit.exhausted for limit in limits):
        note += "; over a cap: the SDK refuses reports past it, so such a device stopped earlier"
    if not math.isfinite(largest):
        note += "; no local privacy: the SDK refuses these reports under any budget"
    return BudgetInUse(
        local_eps=_finite(largest) if reports else None,
        reports=len(reports),
        spent=_finite(total),
        limits=limits,
        note=note,
    )


class LedgerService:
    """Reads the privacy ledger; charges epochs stored before the ledger existed."""

    def __init__(
        self,
        store: AnalyzerStore,
        channels: Mapping[str, ChannelRuntime],
        delta: float = LIFETIME_DELTA,
        device_budget: DeviceBudget | None = None,
    ) -> None:
        self.store = store
        self.channels = channels
        self.delta = delta
        self.device_budget = device_budget

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

    def items(self, channel_id: str) -> list[Item]:
        """The channel's charged epochs with its runtime (UnknownChannelError if unknown)."""
        rows = self.rows(channel_id)
        return [(self.channels[channel_id], r) for r in rows]

    def ledger(self, channel_id: str) -> Ledger:
        """``GET /v1/channels/{id}/privacy``."""
        items = self.items(channel_id)
        natural, used = compose_items(items, self.delta)
        deleted, _ = compose_items(items, self.delta, deleted=True)
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
        config = self.channels[channel_id].config
        return Ledger(
            channel_id=channel_id,
            epochs=[
                r.model_copy(update={"composed_as": how})
                for (_, r), how in zip(items, used, strict=True)
            ],
            lifetime=natural,
            releases=published,
            note=NOTE,
            with_randomized_deletion=deleted,
            device_budget=budget_in_use(
                items,
                config.budget,
                self.device_budget,
                CHANNEL_SCOPE,
            ),
        )

    def overview(self) -> PrivacyOverview:
        """``GET /v1/privacy``: a device in every epoch of every configured channel."""
        items = [item for channel_id in self.channels for item in self.items(channel_id)]
        mixed = len({r.certificate.neighbouring for _, r in items}) > 1
        natural, _ = compose_items(items, self.delta, replacement=mixed)
        deleted, _ = compose_items(items, self.delta, deleted=True)
        return PrivacyOverview(
            channels=list(self.channels),
            epochs=len(items),
            lifetime=natural,
            note=f"{len(items)} epochs over {len(self.channels)} channels; {NOTE}",
            with_randomized_deletion=deleted,
            device_budget=budget_in_use(items, None, self.device_budget, "of every channel so far"),
        )
