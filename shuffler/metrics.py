"""The shuffler's counters and its Prometheus collector (``GET /metrics``, behind a credential:
PROTOCOL.md — exact group sizes, pending counts and deletions are secrets until a batch is
released, since publishing them would void randomized deletion).

Only aggregate counts by cause: nothing per client, no timestamps, no identifiers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.exc import SQLAlchemyError

COUNTERS = {
    "contributions_received": "contributions acknowledged (202)",
    "batches_released": "batches created by Algorithm 3",
    "batches_forwarded": "batch parts acknowledged by the analyzer",
    "batches_retried": "forwarding attempts of a part that will be retried",
    "batches_failed": "batch parts whose content the analyzer refused (kept until retention)",
}
DELETION_CAUSES = ("randomized_deletion", "abort", "retention")
QUEUE_STATES = ("pending", "held", "in_batches_unforwarded")
REJECTED = "rejected_"


class Events:
    """Process-wide event counters (``rejected_<code>`` for refused contributions,
    ``group_<status>``, …) and refusals by the other routes, per (route, code)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.refusals: dict[tuple[str, str], int] = {}

    def count(self, event: str, amount: int = 1) -> None:
        """Add ``amount`` to ``event``."""
        self.counts[event] = self.counts.get(event, 0) + amount

    def refuse(self, route: str, code: str) -> None:
        """Count a refusal by a route other than ``POST /v1/contributions`` (admin, enroll,
        metrics): never mixed with refused contributions. ``route`` is a path template."""
        self.refusals[route, code] = self.refusals.get((route, code), 0) + 1

    def get(self, event: str) -> int:
        """The count of ``event`` so far."""
        return self.counts.get(event, 0)


class ShufflerCollector:
    """Prometheus metrics read at scrape time from the counters and the store's ledger."""

    def __init__(self, events: Events, ledger: Callable[[], dict[str, int]]) -> None:
        self.events = events
        self.ledger = ledger

    def describe(self) -> Iterator[Any]:
        """The metric names, without reading the store: registration runs before the
        migrations, and ``collect`` would query tables that do not exist yet."""
        yield from self._counters()
        yield GaugeMetricFamily(
            "esa_shuffler_queue_depth", "contributions by state", labels=["state"]
        )

    def collect(self) -> Iterator[Any]:
        yield from self._counters()
        try:
            ledger = self.ledger()
        except SQLAlchemyError:
            return
        depth = GaugeMetricFamily(
            "esa_shuffler_queue_depth", "contributions by state", labels=["state"]
        )
        for state in QUEUE_STATES:
            depth.add_metric([state], ledger[state])
        yield depth

    def _counters(self) -> Iterator[Any]:
        for name, help_text in COUNTERS.items():
            yield CounterMetricFamily(
                f"esa_shuffler_{name}", help_text, value=self.events.get(name)
            )
        rejected = CounterMetricFamily(
            "esa_shuffler_contributions_rejected",
            "contributions refused (POST /v1/contributions only)",
            labels=["reason"],
        )
        for key, value in list(self.events.counts.items()):
            if key.startswith(REJECTED):
                rejected.add_metric([key.removeprefix(REJECTED)], value)
        yield rejected
        refused = CounterMetricFamily(
            "esa_shuffler_requests_rejected",
            "requests refused by the other routes (admin, enroll, metrics)",
            labels=["route", "reason"],
        )
        for (route, code), value in list(self.events.refusals.items()):
            refused.add_metric([route, code], value)
        yield refused
        deleted = CounterMetricFamily(
            "esa_shuffler_contributions_deleted", "deleted", labels=["cause"]
        )
        for cause in DELETION_CAUSES:
            deleted.add_metric([cause], self.events.get(f"deleted_by_{cause}"))
        yield deleted
