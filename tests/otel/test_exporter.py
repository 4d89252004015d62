"""The exporter: aggregation within an epoch, one report per channel and epoch, what is dropped,
what never leaves, the device budget, state over periods. A real MeterProvider records through
the OpenTelemetry API; a real Client queues sealed contributions the test opens."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from common.wire import DeviceBudget
from encoder_client.otel import EsaMetricExporter, MappingError, hash_bin

from .helpers import SURE, Device, device, krr_channel, state_channel

DURATION = "http.server.request.duration"
ROUTES = ["/", "/items/{item_id}", "/search"]
CATEGORY = {
    "kind": "category",
    "channel": "routes",
    "instrument": DURATION,
    "attribute": "http.route",
    "values": ROUTES,
}
BOUNDS = [0.01, 0.1, 1.0]
BUCKETS = {"kind": "buckets", "channel": "latency", "instrument": DURATION, "boundaries": BOUNDS}


@pytest.fixture
def phone(tmp_path: Path) -> Iterator[Device]:
    made = device(tmp_path, [krr_channel("routes"), krr_channel("latency"), state_channel()])
    yield made
    made.close()


def _exporter(phone: Device, *rules: dict[str, Any]) -> EsaMetricExporter:
    return EsaMetricExporter(
        phone.client, {"rules": list(rules)}, clock=phone.clock, background=False
    )


def test_the_most_frequent_route_is_reported_once_per_epoch(phone: Device) -> None:
    exporter = _exporter(phone, CATEGORY)
    provider, reader = phone.provider(exporter)
    duration = provider.get_meter("app").create_histogram(DURATION)
    for route, times in (("/", 2), ("/search", 3)):
        for _ in range(times):
            duration.record(0.05, {"http.route": route, "http.request.method": "GET"})
    reader.collect()  # before the report point: only tallied
    for _ in range(2):  # a second export adds to the same epoch's tally: "/" now leads, 4 to 3
        duration.record(0.05, {"http.route": "/"})
    reader.collect()
    assert phone.contributions() == []
    phone.clock.at(0.8)
    reader.collect()  # nothing new recorded: the SDK does not even call the exporter
    assert phone.contributions() == []
    exporter.tick()  # what the exporter's thread does at the report point
    assert phone.values("routes") == [0]
    duration.record(0.05, {"http.route": "/search"})  # after the report: stays on the device
    phone.clock.at(0.99)
    reader.collect()
    assert phone.values("routes") == [0]
    (contribution,) = phone.contributions()
    assert contribution.epoch == phone.clock.epoch
    phone.clock.at(0.9, epochs=1)  # the next epoch starts a new tally
    duration.record(0.05, {"http.route": "/items/{item_id}"})
    reader.collect()
    assert sorted(phone.values("routes")) == [0, 1]
    assert exporter.stats()["routes"].reported == 2


def test_ties_go_to_the_lowest_bin_and_hashing_uses_the_domain(phone: Device) -> None:
    hashed = {**CATEGORY, "channel": "latency", "values": None, "hash": True}
    exporter = _exporter(phone, {**CATEGORY, "values": list(reversed(ROUTES))}, hashed)
    provider, reader = phone.provider(exporter)
    duration = provider.get_meter("app").create_histogram(DURATION)
    duration.record(0.05, {"http.route": "/"})  # bin 2
    duration.record(0.05, {"http.route": "/search"})  # bin 0
    phone.clock.at(0.8)
    reader.collect()
    assert phone.values("routes") == [0]
    assert phone.values("latency") == [min(hash_bin("/", 8), hash_bin("/search", 8))]


def test_outside_the_domain_is_dropped_and_unmapped_data_never_leave(
    phone: Device, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = _exporter(phone, {**CATEGORY, "match": {"http.request.method": "GET"}})
    provider, reader = phone.provider(exporter)
    meter = provider.get_meter("app")
    duration = meter.create_histogram(DURATION)
    secrets = meter.create_counter("app.secrets")
    with caplog.at_level(logging.WARNING, logger="esa.client.otel"):
        duration.record(0.05, {"http.route": "/admin", "http.request.method": "GET"})
        duration.record(0.05, {"http.request.method": "GET"})  # no route attribute
        duration.record(0.05, {"http.route": "/", "http.request.method": "POST"})  # not matched
        secrets.add(5, {"user": "alice"})
        phone.clock.at(0.8)
        reader.collect()
        secrets.add(1)
        reader.collect()
    stats = exporter.stats()["routes"]
    assert (stats.dropped, stats.reported) == (2, 0)
    assert phone.contributions() == []  # nothing mappable, so no report at all
    unmapped = [r for r in caplog.records if "'app.secrets' is not mapped" in r.getMessage()]
    assert len(unmapped) == 1  # a warning once, not per export
    assert any("without attribute 'http.route'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("report", "expected"), [("median", 1), ("mode", 3)])
def test_bucket_channels_report_the_median_or_the_fullest_bucket(
    phone: Device, report: str, expected: int
) -> None:
    exporter = _exporter(phone, {**BUCKETS, "report": report})
    provider, reader = phone.provider(exporter)
    duration = provider.get_meter("app").create_histogram(DURATION)
    for seconds in [0.05, 0.05, 0.005, 5.0, 5.0, 7.0]:  # buckets 1, 1, 0, 3, 3, 3
        duration.record(seconds, {"http.route": "/"})
    phone.clock.at(0.8)
    reader.collect()
    assert phone.values("latency") == [expected]


def test_histograms_without_the_mapped_boundaries_are_dropped(phone: Device) -> None:
    exporter = _exporter(phone, BUCKETS)
    provider, reader = phone.provider(exporter)  # with exporter.views(): the mapped boundaries
    provider.get_meter("app").create_histogram(DURATION).record(0.5)
    bare_exporter = _exporter(phone, BUCKETS)
    bare_reader = PeriodicExportingMetricReader(bare_exporter, export_interval_millis=10**9)
    bare = MeterProvider(metric_readers=[bare_reader])  # the SDK's default buckets
    phone.providers.append(bare)
    bare.get_meter("app").create_histogram(DURATION).record(0.5)
    phone.clock.at(0.8)
    bare_reader.collect()
    assert bare_exporter.stats()["latency"].dropped == 1
    assert phone.contributions() == []
    reader.collect()
    assert phone.values("latency") == [2]


def test_the_device_budget_is_respected_without_raising(tmp_path: Path) -> None:
    # k-RR replacement ε is SURE per report: the budget admits exactly one.
    phone = device(tmp_path, [krr_channel("routes")], DeviceBudget(lifetime_eps=SURE))
    try:
        exporter = _exporter(phone, CATEGORY)
        provider, reader = phone.provider(exporter)
        duration = provider.get_meter("app").create_histogram(DURATION)
        for epochs in (0, 1, 1):
            duration.record(0.05, {"http.route": "/search"})
            phone.clock.at(0.8, epochs=epochs)
            reader.collect()
        stats = exporter.stats()["routes"]
        assert (stats.reported, stats.budget_refused) == (1, 2)  # one per epoch, no raise
        assert phone.values("routes") == [2]
        assert phone.client.budget_spent() == pytest.approx(SURE)
    finally:
        phone.close()


def test_an_epoch_slept_through_expires_and_shutdown_reports_early(phone: Device) -> None:
    exporter = _exporter(phone, CATEGORY)
    provider, reader = phone.provider(exporter)
    duration = provider.get_meter("app").create_histogram(DURATION)
    duration.record(0.05, {"http.route": "/search"})
    reader.collect()
    phone.clock.at(0.1, epochs=2)  # the app slept past the report point of its epoch
    exporter.tick()
    assert exporter.stats()["routes"].expired == 1
    assert phone.contributions() == []
    duration.record(0.05, {"http.route": "/items/{item_id}"})
    provider.shutdown()  # stopping at 10% of the epoch: report what there is now
    assert phone.values("routes") == [1]
    assert phone.contributions()[0].epoch == phone.clock.epoch


def test_a_state_over_periods_feeds_the_longitudinal_reporter(phone: Device) -> None:
    first = phone.clock.epoch
    state = {
        "kind": "state",
        "channel": "abroad",
        "instrument": "app.roaming",
        "first_epoch": first + 1,
    }
    exporter = _exporter(phone, state)
    provider, reader = phone.provider(exporter)
    roaming = [0]

    def observe(options: CallbackOptions) -> list[Observation]:
        return [Observation(roaming[0])]

    provider.get_meter("app").create_observable_gauge("app.roaming", [observe])
    # Epoch `first` is before period 1; then periods 1..4 with the gauge at 0, 1, 1, 0.
    for epochs, level in enumerate([1, 0, 1, 1, 0]):
        roaming[0] = level
        phone.clock.at(0.1, epochs=0 if epochs == 0 else 1)
        reader.collect()  # one observation early in the epoch ...
        phone.clock.at(0.8)
        reader.collect()  # ... and one at the report point
    stats = exporter.stats()["abroad"]
    assert (stats.outside_periods, stats.reported) == (1, 4)
    saved = phone.client.state.channel_state("abroad", "longitudinal")
    assert saved is not None
    # The mechanism saw periods 1..4 with changes at 2 (0 -> 1) and 4 (1 -> 0): two changes,
    # now off, last period 4 (Erlingsson et al. 2019, Algorithm 1's κ).
    assert (saved["tree"][2], saved["st"], saved["last"]) == (2, 0, 4)
    assert phone.client.state.channel_state("otel:abroad", "otel-state") == {
        "state": 0,
        "period": 4,
    }


def test_a_state_attribute_with_true_values(phone: Device) -> None:
    state = {
        "kind": "state",
        "channel": "abroad",
        "instrument": "app.sessions",
        "attribute": "network.roaming",
        "true_values": [True],
        "first_epoch": phone.clock.epoch,
    }
    exporter = _exporter(phone, state)
    provider, reader = phone.provider(exporter)
    sessions = provider.get_meter("app").create_counter("app.sessions")
    sessions.add(3, {"network.roaming": True})
    sessions.add(1, {"network.roaming": False})
    phone.clock.at(0.8)
    reader.collect()
    assert phone.client.state.channel_state("otel:abroad", "otel-state") == {
        "state": 1,
        "period": 1,
    }


def test_mapping_errors_surface_at_construction(phone: Device) -> None:
    with pytest.raises(MappingError, match="report_at"):
        EsaMetricExporter(phone.client, {"rules": [CATEGORY]}, report_at=1.0)
    with pytest.raises(MappingError, match="not in the collection config"):
        _exporter(phone, {**CATEGORY, "channel": "elsewhere"})
