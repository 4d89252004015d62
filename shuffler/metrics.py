"""The shuffler's counters and its Prometheus collector (``GET /metrics``, behind a credential:
PROTOCOL.md — exact group sizes, pending counts and deletions are secrets until a batch is
released, since publishing them would void randomized deletion).

The counters (``esa_shuffler_*_total``) are this process's events since it started; the gauges
are read from the database at scrape time, so they are the whole trust domain's. Only aggregate
counts by cause: nothing per client, per group, no timestamps, no identifiers. Every metric:
docs/shuffler.md, "Metrics".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.exc import SQLAlchemyError

from runtime.conservation import DELETION_CAUSES, LEDGER_CONTRIBUTIONS, LEDGER_DELETED

COUNTERS = {
    "contributions_received": "contributions acknowledged (202)",
    "batches_released": "batches created by Algorithm 3",
    "batches_forwarded": "batch parts acknowledged by the analyzer",
    "batches_retried": "forwarding attempts of a part that will be retried",
    "batches_failed": "batch parts whose content the analyzer refused (kept until requeued "
    "by an admin or purged by retention)",
}
QUEUE_STATES = ("pending", "held", "in_batches_unforwarded", "in_batches_refused")
REJECTED = "rejected_"
#: The ledger's states and its deletions by cause, as read in one snapshot.
Ledger = tuple[dict[str, int], dict[str, int]]


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
    """Prometheus metrics read at scrape time from the counters (this process's) and the
    database (the trust domain's): ``ledger`` returns the ledger and its deletions by cause,
    read in one snapshot (:meth:`shuffler.store.ContributionStore.ledger_by_cause`)."""

    def __init__(self, events: Events, ledger: Callable[[], Ledger]) -> None:
        self.events = events
        self.ledger = ledger

    def describe(self) -> Iterator[Any]:
        """The metric names, without reading the store: registration runs before the
        migrations, and ``collect`` would query tables that do not exist yet."""
        yield from self._counters()
        yield from self._gauges(({}, {}))

    def collect(self) -> Iterator[Any]:
        """The counters, then the database's gauges (none while the store cannot be read)."""
        yield from self._counters()
        try:
            ledger = self.ledger()
        except SQLAlchemyError:
            return
        yield from self._gauges(ledger)

    def _gauges(self, ledger: Ledger) -> Iterator[GaugeMetricFamily]:
        """The trust domain's gauges from the ledger (empty: the families alone, to describe)."""
        states, causes = ledger
        depth = GaugeMetricFamily(
            "esa_shuffler_queue_depth", "contributions by state", labels=["state"]
        )
        where = GaugeMetricFamily(
            LEDGER_CONTRIBUTIONS,
            "every contribution the trust domain acknowledged, by where it is now (database)",
            labels=["state"],
        )
        deleted = GaugeMetricFamily(
            LEDGER_DELETED,
            "contributions the trust domain deleted, by cause (database)",
            labels=["cause"],
        )
        for state in QUEUE_STATES if states else ():
            depth.add_metric([state], states[state])
        for state, value in states.items():  # every key: disjoint states, summing to all
            where.add_metric([state], value)
        for cause, value in causes.items():
            deleted.add_metric([cause], value)
        yield from (depth, where, deleted)

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
