"""The analyzer's event counters and gauges, and their Prometheus view (read at scrape time).

The counters (``esa_analyzer_*_total``) are this process's events since it started; the gauges
(:data:`LEDGER`, the per-channel families for :data:`CHANNEL_EPOCHS` epochs) are read from the
database at scrape time, the same at every worker; labels are channel ids of the collection
config only. Details: docs/architecture.md, "Metrics"; every metric: docs/operations.md.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.exc import SQLAlchemyError

from analyzer.records import EpochHealth
from runtime import db
from runtime.conservation import ANALYZER_FRAGMENTS, FRAGMENT_STATES

log = logging.getLogger("esa.analyzer")

#: Counters every scrape shows (zero until the event happens), with their help text.
COUNTERS = {
    "parts_stored": "batch parts stored (acknowledged)",
    "parts_opened": "batch parts opened and accumulated",
    "batches_accepted": "batches complete (every part opened and accumulated)",
    "batches_duplicate": "batch parts seen before (counted once)",
    "fragments_opened": "fragments opened",
    "fragments_invalid": "fragments that failed to open or parse (chaff), and opened ones "
    "repeating a fragment already counted in their epoch",
    "fragments_repeated": "opened fragments already counted in their channel's epoch (same "
    "sealed fragment again: counted once, the first time)",
    "part_open_failures": "failed openings of stored parts (retried, then quarantined)",
    "batches_short_crowd": "complete batches whose fragments verify fewer contributions than "
    "their shuffler claimed (certified at the verified crowd)",
    "crowd_shortfall": "contributions claimed by shufflers that their batches' fragments do "
    "not verify",
    "batches_withheld": "complete batches never released: their fragments verify fewer "
    "contributions than the channel's min_crowd",
    "parts_purged_incomplete": "parts of batches that never completed, deleted after "
    "incomplete_retention_seconds",
    "releases": "estimates released (ledger entries)",
    "requests_head_timeout": "requests whose head did not arrive within head_timeout_seconds "
    "(408 head_timeout, or a connection that sent nothing, closed)",
    "requests_body_timeout": "requests whose body did not arrive within body_timeout_seconds "
    "or arrived below body_min_rate_bytes (408 body_timeout, connection closed)",
    "epochs_closed": "(channel, crowd, epoch) groups closed at their timeout "
    "(epoch_close_seconds after the epoch's end) before every shuffler delivered",
    "requests_write_timeout": "connections dropped because the client read none of its "
    "answers for body_timeout_seconds",
}
#: Gauges read from the database at scrape time (registered with :meth:`AnalyzerEvents.gauge`).
GAUGES = {
    "parts_quarantined": "batch parts set aside after repeated failed openings (kept with "
    "their error, never accumulated: their batches stay incomplete)",
}
REJECTED = "rejected_"
#: The fragment ledger's gauge (read from the database: every worker's parts together).
LEDGER = ANALYZER_FRAGMENTS
LEDGER_HELP = (
    "fragments in every part opened by any analyzer worker sharing the database, per channel: "
    "opened (decrypted) and invalid (failed to open or parse)"
)
#: Per configured channel, its fragments in opened parts: (opened, invalid).
FragmentLedger = Callable[[], Mapping[str, tuple[int, int]]]
#: Epochs per channel in the per-channel families: the newest few, since every epoch label is a
#: new series and epochs never stop (Prometheus: keep label cardinality bounded).
CHANNEL_EPOCHS = 8
#: Per-channel health of each channel's newest epochs, given how many
#: (:meth:`analyzer.store.AnalyzerStore.channel_health`).
Health = Callable[[int], Sequence[EpochHealth]]
_NEWEST = f"per channel and epoch (its {CHANNEL_EPOCHS} newest with a batch)"
CHANNEL_CONTRIBUTIONS = "esa_analyzer_channel_contributions"
CHANNEL_BATCHES = "esa_analyzer_channel_batches"
CHANNEL_QUARANTINED = "esa_analyzer_channel_parts_quarantined"
CHANNEL_INVALID = "esa_analyzer_channel_fragments_invalid"
CHANNEL_RELEASES = "esa_analyzer_channel_releases"
CHANNEL_HELP = {
    CHANNEL_CONTRIBUTIONS: f"contributions {_NEWEST}: received (the crowd every batch claims, "
    "summed over shufflers, complete or not) and verified (the crowd the complete batches "
    "verify)",
    CHANNEL_BATCHES: f"batches {_NEWEST}: complete (every part opened; withheld ones "
    "included), withheld (complete, verified crowd below min_crowd: never released) and "
    "incomplete",
    CHANNEL_QUARANTINED: f"batch parts set aside after repeated failed openings {_NEWEST}",
    CHANNEL_INVALID: f"fragments of complete batches that failed to open or parse (chaff) "
    f"{_NEWEST}",
    CHANNEL_RELEASES: f"published releases whose epoch range includes the epoch {_NEWEST}",
}


class AnalyzerEvents:
    """Thread-safe event counts (``rejected_<code>`` for every refusal), and the gauges read
    at scrape time."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._gauges: dict[str, Callable[[], int]] = {}
        self._lock = threading.Lock()

    def count(self, event: str, amount: int = 1) -> None:
        """Add ``amount`` to ``event``."""
        with self._lock:
            self._counts[event] = self._counts.get(event, 0) + amount

    def get(self, event: str) -> int:
        """How often ``event`` happened."""
        with self._lock:
            return self._counts.get(event, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of every count."""
        with self._lock:
            return dict(self._counts)

    def gauge(self, name: str, read: Callable[[], int]) -> None:
        """Export ``read()`` as the gauge ``name`` (one of :data:`GAUGES`) at every scrape."""
        with self._lock:
            self._gauges[name] = read

    def gauges(self) -> dict[str, Callable[[], int]]:
        """The registered gauges."""
        with self._lock:
            return dict(self._gauges)


class EventsCollector:
    """Prometheus collector over :class:`AnalyzerEvents`, and the intake backlog, the fragment
    ledger (:meth:`analyzer.store.AnalyzerStore.fragment_ledger`) and the per-channel health of the
    :data:`CHANNEL_EPOCHS` newest epochs (``health``) read at scrape time (none of the last
    two when not given)."""

    def __init__(
        self,
        events: AnalyzerEvents,
        backlog: Callable[[], int],
        ledger: FragmentLedger | None = None,
        health: Health | None = None,
    ) -> None:
        self.events = events
        self.backlog = backlog
        self.ledger = ledger
        self.health = health

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The metric names, without reading the database (registration runs before the
        migrations)."""
        yield GaugeMetricFamily("esa_analyzer_parts_unopened", "stored batch parts not yet opened")
        for name, help_text in GAUGES.items():
            yield GaugeMetricFamily(f"esa_analyzer_{name}", help_text)
        yield GaugeMetricFamily(LEDGER, LEDGER_HELP, labels=["channel", "state"])
        if self.health is not None:
            yield from channel_families(())
        yield from self._counters()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """``esa_analyzer_<counter>``, ``esa_analyzer_batches_rejected{reason}``,
        ``esa_analyzer_parts_unopened`` (stored parts the opener has not accumulated yet),
        ``esa_analyzer_parts_quarantined``, :data:`LEDGER` and the per-channel families; a
        gauge the database cannot answer now is NaN (the ledger and the per-channel families
        then have no sample)."""
        yield GaugeMetricFamily(
            "esa_analyzer_parts_unopened",
            "stored batch parts not yet opened",
            value=_read(self.backlog),
        )
        reads = self.events.gauges()
        for name, help_text in GAUGES.items():
            read = reads.get(name)
            value = 0.0 if read is None else _read(read)
            yield GaugeMetricFamily(f"esa_analyzer_{name}", help_text, value=value)
        yield self._ledger()
        yield from self._channels()
        yield from self._counters()

    def _ledger(self) -> GaugeMetricFamily:
        """:data:`LEDGER`: two samples per configured channel, none without a ledger or while
        the database is unavailable (a scrape never fails because of it)."""
        family = GaugeMetricFamily(LEDGER, LEDGER_HELP, labels=["channel", "state"])
        if self.ledger is None:
            return family
        try:
            counts = self.ledger()
        except SQLAlchemyError:
            log.warning("metrics: database unavailable for the fragment ledger")
            return family
        for channel, found in sorted(counts.items()):
            for state, value in zip(FRAGMENT_STATES, found, strict=True):  # (opened, invalid)
                family.add_metric([channel, state], value)
        return family

    def _channels(self) -> list[GaugeMetricFamily]:
        """The per-channel families; none without ``health`` or while the database is
        unavailable (a scrape never fails because of it)."""
        if self.health is None:
            return []
        try:
            return channel_families(self.health(CHANNEL_EPOCHS))
        except SQLAlchemyError:
            log.warning("metrics: database unavailable for the per-channel health")
            return []

    def _counters(self) -> Iterator[CounterMetricFamily]:
        counts = self.events.snapshot()
        for name, help_text in COUNTERS.items():
            yield CounterMetricFamily(f"esa_analyzer_{name}", help_text, value=counts.get(name, 0))
        rejected = CounterMetricFamily(
            "esa_analyzer_batches_rejected", "refused batches", labels=["reason"]
        )
        for key, value in counts.items():
            if key.startswith(REJECTED):
                rejected.add_metric([key.removeprefix(REJECTED)], value)
        yield rejected
        yield db.TRANSACTIONS.family("analyzer.")  # this process's, by name and outcome


def _read(read: Callable[[], int]) -> float:
    """A gauge read from the database; NaN while the database is unavailable (a scrape never
    fails because of it)."""
    try:
        return float(read())
    except SQLAlchemyError:
        log.warning("metrics: database unavailable for a gauge")
        return math.nan


def channel_families(health: Sequence[EpochHealth]) -> list[GaugeMetricFamily]:
    """The per-channel families (:data:`CHANNEL_HELP`) for ``health`` (empty: the families
    alone), labelled by channel and epoch."""
    kinds = {CHANNEL_CONTRIBUTIONS: ["stage"], CHANNEL_BATCHES: ["state"]}
    families = {
        name: GaugeMetricFamily(name, help_text, labels=["channel", "epoch", *kinds.get(name, [])])
        for name, help_text in CHANNEL_HELP.items()
    }
    for row in health:
        key = [row.channel_id, str(row.epoch)]
        families[CHANNEL_CONTRIBUTIONS].add_metric([*key, "received"], row.received)
        families[CHANNEL_CONTRIBUTIONS].add_metric([*key, "verified"], row.verified)
        families[CHANNEL_BATCHES].add_metric([*key, "complete"], row.batches_complete)
        families[CHANNEL_BATCHES].add_metric([*key, "withheld"], row.batches_withheld)
        families[CHANNEL_BATCHES].add_metric([*key, "incomplete"], row.batches_incomplete)
        families[CHANNEL_QUARANTINED].add_metric(key, row.parts_quarantined)
        families[CHANNEL_INVALID].add_metric(key, row.fragments_invalid)
        families[CHANNEL_RELEASES].add_metric(key, row.releases)
    return list(families.values())
