"""The analyzer's event counters and their Prometheus view (read at scrape time)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: Counters every scrape shows (zero until the event happens), with their help text.
COUNTERS = {
    "parts_stored": "batch parts stored (acknowledged)",
    "parts_opened": "batch parts opened and accumulated",
    "batches_accepted": "batches complete (every part opened and accumulated)",
    "batches_duplicate": "batch parts seen before (counted once)",
    "fragments_opened": "fragments opened",
    "fragments_invalid": "fragments that failed to open or parse (chaff)",
    "releases": "estimates released (ledger entries)",
}
REJECTED = "rejected_"


class Events:
    """Thread-safe event counts (``rejected_<code>`` for every refusal)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
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


class EventsCollector:
    """Prometheus collector over :class:`Events`, and the intake backlog read at scrape time."""

    def __init__(self, events: Events, backlog: Callable[[], int]) -> None:
        self.events = events
        self.backlog = backlog

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The metric names, without reading the database (registration runs before the
        migrations)."""
        yield GaugeMetricFamily("esa_analyzer_parts_unopened", "stored batch parts not yet opened")
        yield from self._counters()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """``esa_analyzer_<counter>``, ``esa_analyzer_batches_rejected{reason}`` and
        ``esa_analyzer_parts_unopened`` (stored parts the opener has not accumulated yet)."""
        yield GaugeMetricFamily(
            "esa_analyzer_parts_unopened", "stored batch parts not yet opened", value=self.backlog()
        )
        yield from self._counters()

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
