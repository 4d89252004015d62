"""The OpenTelemetry bridge: an app's OTel metrics reach ESA channels, aggregated on the device.

Needs the ``otel`` extra. :class:`EsaMetricExporter` keeps, per mapped channel, a tally of the
current epoch (nothing is sent per export) and submits ONE value per channel and epoch through
the SDK's reporters: the most frequent attribute value (``category``), the median or fullest
bucket (``buckets``), or whether the majority state changed (``state``). The value is reported
at the first export at or after ``report_at`` of the epoch and at shutdown; an epoch slept
through is discarded. Unmapped instruments and attributes, values outside a channel's domain
anything past the device budget, and reports on a channel whose signed config relaxes the
privacy terms the device pinned or exceeds the app's caps never leave the device, and never
raise in the app.

Usage, mapping and what is sent: docs/otel.md.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableCounter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    PeriodicExportingMetricReader,
    Sum,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from encoder_client._client import Client
from encoder_client._errors import (
    AlreadyReportedError,
    BudgetExceededError,
    EsaError,
    PrivacyCapError,
    PrivacyRelaxedError,
    ValueOutOfDomainError,
)
from encoder_client.otel_mapping import (
    BoundRule,
    BucketRule,
    CategoryRule,
    MappingError,
    MappingSpec,
    StateRule,
    bind,
    hash_bin,
    load_mapping,
    text,
)

__all__ = [
    "ChannelStats",
    "EsaMetricExporter",
    "MappingError",
    "MappingSpec",
    "hash_bin",
    "load_mapping",
    "meter_provider",
]

log = logging.getLogger("esa.client.otel")
#: Where a state rule keeps the last state it reported, in the SDK's state file (a ``:`` never
#: appears in a channel id, so this never collides with a channel's own state).
STATE_KEY = "otel:{channel}"
STATE_KIND = "otel-state"


@dataclass
class ChannelStats:
    """What the exporter did for one channel since it started.

    Attributes:
        reported: Reports submitted to the SDK (one per epoch at most).
        dropped: Data points (or histogram buckets) outside the channel's domain or vocabulary,
            or without the rule's attribute: never sent.
        budget_refused: Reports the device budget (or the app's lifetime cap) refused.
        privacy_refused: Reports refused because the config in force relaxes the channel's
            pinned privacy terms or exceeds the app's caps (:class:`encoder_client.PrivacyCaps`,
            set on the :class:`Client` given to the exporter).
        already_reported: Epochs the channel already had a report in (e.g. before a restart).
        expired: Epoch tallies whose epoch ended before their report point.
        outside_periods: Epochs before period 1 or after the last period of a state rule.
        refused: Reports the SDK refused for another reason (logged).
    """

    reported: int = 0
    dropped: int = 0
    budget_refused: int = 0
    privacy_refused: int = 0
    already_reported: int = 0
    expired: int = 0
    outside_periods: int = 0
    refused: int = 0


@dataclass
class _Epoch:
    epoch: int
    counts: dict[int, float] = field(default_factory=dict)
    done: bool = False


class EsaMetricExporter(MetricExporter):
    """A ``MetricExporter`` that feeds ESA channels through a declarative mapping.

    ``report_at`` is the fraction of an epoch (0 < x < 1) after which its value is reported;
    ``background`` wakes the exporter at every report point even when no export comes (off in
    tests that move a fake clock and call :meth:`tick`). Arguments: docs/otel.md, "The exporter".

    Raises:
        MappingError: the mapping does not validate or does not fit the signed config.
    """

    def __init__(
        self,
        client: Client,
        mapping: MappingSpec | Mapping[str, Any] | str | Path,
        *,
        report_at: float = 0.75,
        clock: Callable[[], float] = time.time,
        close_client: bool = False,
        background: bool = True,
    ) -> None:
        if not 0.0 < report_at < 1.0:
            raise MappingError(f"report_at must be in (0, 1), got {report_at!r}")
        super().__init__(
            preferred_temporality={
                Counter: AggregationTemporality.DELTA,
                Histogram: AggregationTemporality.DELTA,
                ObservableCounter: AggregationTemporality.DELTA,
            }
        )
        self._client = client
        self.mapping = load_mapping(mapping)
        self._rules = bind(self.mapping, client)
        self._report_at = report_at
        self._clock = clock
        self._close_client = close_client
        self._lock = threading.Lock()
        self._epochs: dict[str, _Epoch] = {}
        self._stats = {r.channel: ChannelStats() for r in self._rules}
        self._warned: set[str] = set()
        self._by_instrument: dict[str, list[BoundRule]] = {}
        for rule in self._rules:
            self._by_instrument.setdefault(rule.rule.instrument, []).append(rule)
        self._stop = threading.Event()
        if background:
            threading.Thread(target=self._run, name="esa-otel-report", daemon=True).start()

    # --- the MetricExporter interface -----------------------------------------------------

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        """Fold one collection into the epochs' tallies, then report what is due."""
        try:
            with self._lock:
                now = self._clock()
                self._roll(now)
                for name, data, point in _points(metrics_data):
                    self._fold(name, data, point)
                self._report_due(now, force=False)
        except Exception:  # an exporter must never take the app's collection thread down
            log.exception("OpenTelemetry export to ESA failed")
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Try to deliver the SDK's outbox now (reports are not made early)."""
        try:
            self._client.flush()
        except Exception:
            log.exception("ESA outbox flush failed")
            return False
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Report the current epoch's tallies now (the app is stopping), try to deliver them,
        and close the client if the exporter owns it."""
        self._stop.set()
        with self._lock:
            now = self._clock()
            self._roll(now)
            self._report_due(now, force=True)
        self.force_flush(timeout_millis)
        if self._close_client:
            self._client.close()

    def tick(self) -> None:
        """Report what is due now without new data (the background thread's work)."""
        with self._lock:
            now = self._clock()
            self._roll(now)
            self._report_due(now, force=False)

    def _run(self) -> None:
        while not self._stop.wait(self._until_next_report()):
            try:
                self.tick()
            except Exception:  # the thread must outlive any single failure
                log.exception("ESA report from the OpenTelemetry bridge failed")

    def _until_next_report(self) -> float:
        """Seconds to the next report point of any rule (just past it)."""
        now = self._clock()
        waits = [
            ((now // r.epoch_seconds + self._report_at) * r.epoch_seconds - now) % r.epoch_seconds
            for r in self._rules
        ]
        return min(waits) + 0.05

    # --- what the exporter did ------------------------------------------------------------

    def stats(self) -> dict[str, ChannelStats]:
        """A snapshot of :class:`ChannelStats` per mapped channel."""
        with self._lock:
            return {channel: replace(s) for channel, s in self._stats.items()}

    def views(self) -> list[View]:
        """OpenTelemetry views giving each ``buckets`` rule's instrument the rule's boundaries
        (pass them to the ``MeterProvider``: otherwise the SDK's default buckets are used and
        such data points are dropped as not matching)."""
        return [
            View(
                instrument_name=r.instrument,
                aggregation=ExplicitBucketHistogramAggregation(boundaries=r.boundaries),
            )
            for r in self.mapping.rules
            if isinstance(r, BucketRule) and r.boundaries is not None
        ]

    # --- aggregation on the device --------------------------------------------------------

    def _roll(self, now: float) -> None:
        """Start a new tally for every channel whose epoch changed; count ended epochs whose
        report point never came."""
        for rule in self._rules:
            epoch = int(now // rule.epoch_seconds)
            current = self._epochs.get(rule.channel)
            if current is not None and current.epoch == epoch:
                continue
            if current is not None and current.counts and not current.done:
                self._stats[rule.channel].expired += 1
            self._epochs[rule.channel] = _Epoch(epoch)

    def _fold(self, name: str, data: Any, point: Any) -> None:
        rules = self._by_instrument.get(name)
        if rules is None:
            self._warn_once(
                f"instrument:{name}",
                "OpenTelemetry instrument %r is not mapped to an ESA channel; its data stay "
                "on the device",
                name,
            )
            return
        for rule in rules:
            if not rule.matches(point.attributes or {}):
                continue
            tally = self._epochs[rule.channel]
            if tally.done:
                continue
            observed = self._observe(rule, data, point)
            if observed is None:
                self._stats[rule.channel].dropped += 1
                continue
            for index, weight in observed:
                if index >= rule.domain:
                    self._stats[rule.channel].dropped += 1
                elif weight > 0:
                    tally.counts[index] = tally.counts.get(index, 0.0) + weight

    def _observe(self, rule: BoundRule, data: Any, point: Any) -> list[tuple[int, float]] | None:
        """``(bin, weight)`` pairs of one data point under ``rule``; None: it cannot be mapped."""
        spec = rule.rule
        if isinstance(spec, BucketRule):
            return self._buckets(rule, spec, point)
        attribute = spec.attribute
        if attribute is None:  # a state rule read from the value itself
            if not isinstance(point, NumberDataPoint):
                return None
            return [(int(point.value != 0), 1.0)]
        attributes = point.attributes or {}
        if attribute not in attributes:
            self._warn_once(
                f"attribute:{rule.channel}",
                "data points of %r without attribute %r are not sent to channel %r",
                spec.instrument,
                attribute,
                rule.channel,
            )
            return None
        value = attributes[attribute]
        if isinstance(spec, CategoryRule):
            index = rule.category_bin(value)
        else:
            index = int(text(value) in {text(v) for v in spec.true_values})
        return None if index is None else [(index, _weight(data, point))]

    def _buckets(
        self, rule: BoundRule, spec: BucketRule, point: Any
    ) -> list[tuple[int, float]] | None:
        if not isinstance(point, HistogramDataPoint):
            return None
        bounds = tuple(float(b) for b in point.explicit_bounds)
        if spec.boundaries is not None and bounds != spec.boundaries:
            self._warn_once(
                f"bounds:{rule.channel}",
                "histogram %r has boundaries %s, not the mapping's %s: not sent to channel %r "
                "(pass EsaMetricExporter.views() to the MeterProvider)",
                spec.instrument,
                list(bounds),
                list(spec.boundaries),
                rule.channel,
            )
            return None
        return [(i, float(c)) for i, c in enumerate(point.bucket_counts) if c > 0]

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # --- reporting ------------------------------------------------------------------------

    def _report_due(self, now: float, force: bool) -> None:
        for rule in self._rules:
            tally = self._epochs[rule.channel]
            due = now >= (tally.epoch + self._report_at) * rule.epoch_seconds
            if tally.done or not (due or force):
                continue
            if isinstance(rule.rule, StateRule):
                tally.done = True
                self._submit(rule, functools.partial(self._report_state, rule, tally))
            elif tally.counts:
                tally.done = True
                value = _choose(rule.rule, tally.counts)
                self._submit(rule, functools.partial(self._report_value, rule, value))

    def _report_value(self, rule: BoundRule, value: int) -> None:
        """Report ``value`` on a category or bucket rule's channel (the reporter is made here,
        inside :meth:`_submit`: a channel refused since binding is counted, never raised)."""
        self._client.histogram(rule.channel, rule.crowd).report(value)

    def _report_state(self, rule: BoundRule, tally: _Epoch) -> bool:
        """One period of a longitudinal channel; False when there is nothing to report."""
        assert isinstance(rule.rule, StateRule)
        period = tally.epoch - rule.rule.first_epoch + 1
        if not 1 <= period <= rule.domain:
            self._stats[rule.channel].outside_periods += 1
            return False
        key = STATE_KEY.format(channel=rule.channel)
        saved = self._client.state.channel_state(key, STATE_KIND) or {"state": 0, "period": 0}
        if int(saved["period"]) >= period:
            self._stats[rule.channel].already_reported += 1
            return False
        previous = int(saved["state"])
        on, off = tally.counts.get(1, 0.0), tally.counts.get(0, 0.0)
        state = previous if on == off else int(on > off)
        self._client.longitudinal(rule.channel, rule.crowd).update(period, state != previous)
        self._client.state.save_state(key, STATE_KIND, {"state": state, "period": period})
        return True

    def _submit(self, rule: BoundRule, report: Callable[[], bool | None]) -> None:
        stats = self._stats[rule.channel]
        try:
            if report() is not False:
                stats.reported += 1
        except BudgetExceededError as error:
            stats.budget_refused += 1
            self._warn_once(f"budget:{rule.channel}", "ESA report not sent: %s", error)
        except (PrivacyRelaxedError, PrivacyCapError) as error:
            stats.privacy_refused += 1
            self._warn_once(f"privacy:{rule.channel}", "ESA report not sent: %s", error)
        except AlreadyReportedError:
            stats.already_reported += 1
        except ValueOutOfDomainError:
            stats.dropped += 1
        except EsaError as error:
            stats.refused += 1
            log.error("ESA report on channel %r refused: %s", rule.channel, error)


def _points(metrics_data: MetricsData) -> Iterator[tuple[str, Any, Any]]:
    """``(instrument name, metric data, data point)`` of every point of a collection."""
    for resource in metrics_data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    yield metric.name, metric.data, point


def _weight(data: Any, point: Any) -> float:
    """How much one data point counts towards its value's share of the epoch."""
    if isinstance(data, HistogramData) or hasattr(point, "count"):
        return float(point.count)
    if isinstance(data, Sum) and data.is_monotonic:
        return max(0.0, float(point.value))
    return 1.0  # a gauge or an up-down counter: one observation of a level per export


def _choose(rule: CategoryRule | BucketRule | StateRule, counts: dict[int, float]) -> int:
    """The value an epoch reports: the median bucket for ``buckets`` rules with
    ``report: median``, else the most frequent bin (ties to the lowest)."""
    if isinstance(rule, BucketRule) and rule.report == "median":
        total, running = sum(counts.values()), 0.0
        for index in sorted(counts):
            running += counts[index]
            if running >= total / 2:
                return index
    return min(counts, key=lambda index: (-counts[index], index))


def meter_provider(
    client: Client,
    mapping: MappingSpec | Mapping[str, Any] | str | Path,
    *,
    export_interval_seconds: float = 60.0,
    report_at: float = 0.75,
    extra_readers: tuple[MetricReader, ...] = (),
    close_client: bool = False,
) -> MeterProvider:
    """A ``MeterProvider`` whose metrics go to ESA: an :class:`EsaMetricExporter` in a
    ``PeriodicExportingMetricReader``, with the views of the mapping's ``buckets`` rules.

    Raises:
        MappingError: the mapping does not validate or does not fit the signed config.
    """
    exporter = EsaMetricExporter(client, mapping, report_at=report_at, close_client=close_client)
    reader = PeriodicExportingMetricReader(
        exporter, export_interval_millis=export_interval_seconds * 1000
    )
    return MeterProvider(metric_readers=[reader, *extra_readers], views=exporter.views())
