"""The analyzer's event counters and their Prometheus view (read at scrape time)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily

#: Counters every scrape shows (zero until the event happens), with their help text.
COUNTERS = {
    "batches_accepted": "batches accumulated",
    "batches_duplicate": "batches seen before (counted once)",
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
    """Prometheus collector over :class:`Events`."""

    def __init__(self, events: Events) -> None:
        self.events = events

    def collect(self) -> Iterator[CounterMetricFamily]:
        """``esa_analyzer_<counter>`` and ``esa_analyzer_batches_rejected{reason}``."""
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
