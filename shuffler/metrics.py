"""The shuffler's counters and its Prometheus collector (``GET /metrics``, behind a credential:
exact group sizes, pending counts and deletions are secrets until a batch is released, since
publishing them would void randomized deletion: docs/protocol.md, "What never leaves a party").

The counters (``esa_shuffler_*_total``) are this process's events since it started; the gauges
are read from the database at scrape time, so they are the whole trust domain's. Only aggregate
counts by cause, and per (channel, epoch) the released groups' counts (a held group counts as
one, never its size): nothing per client, no timestamps, no identifiers. Every metric:
docs/shuffler.md, "Metrics".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.exc import SQLAlchemyError

from runtime import db
from runtime.conservation import DELETION_CAUSES, LEDGER_CONTRIBUTIONS, LEDGER_DELETED
from shuffler.records import EpochGroups

COUNTERS = {
    "contributions_received": "contributions acknowledged (202)",
    "batches_released": "batches created by Algorithm 3",
    "batches_forwarded": "batch parts acknowledged by the analyzer",
    "batches_retried": "forwarding attempts of a part that will be retried",
    "batches_failed": "batch parts whose content the analyzer refused (kept until requeued "
    "by an admin or purged by retention)",
    "requests_head_timeout": "requests whose head did not arrive within head_timeout_seconds "
    "(408 head_timeout, or a connection that sent nothing, closed)",
    "requests_body_timeout": "requests whose body did not arrive within body_timeout_seconds "
    "or arrived below body_min_rate_bytes (408 body_timeout, connection closed)",
    "requests_write_timeout": "connections dropped because the client read none of its "
    "answers for body_timeout_seconds",
}
QUEUE_STATES = ("pending", "held", "in_batches_unforwarded", "in_batches_refused")
REJECTED = "rejected_"
#: The ledger's states and its deletions by cause, as read in one snapshot.
Ledger = tuple[dict[str, int], dict[str, int]]
#: Epochs per channel in the per-channel families: the newest few, since every epoch label is a
#: new series and epochs never stop (Prometheus: keep label cardinality bounded).
CHANNEL_EPOCHS = 8
#: Per-channel health of each channel's newest epochs, given how many
#: (:meth:`shuffler.store.ContributionStore.channel_health`).
Health = Callable[[int], Sequence[EpochGroups]]
OUTCOMES = ("released", "held", "aborted")
STAGES = ("received", "deleted", "batched", "forwarded")
CHANNEL_GROUPS = "esa_shuffler_channel_groups"
CHANNEL_CONTRIBUTIONS = "esa_shuffler_channel_contributions"
GROUPS_HELP = (
    f"groups Algorithm 3 evaluated, per channel and epoch (its {CHANNEL_EPOCHS} newest), by "
    "outcome: released, held (below the crowd threshold) or aborted (database)"
)
CONTRIBUTIONS_HELP = (
    f"contributions of the RELEASED groups only, per channel and epoch (its {CHANNEL_EPOCHS} "
    "newest): received (= deleted + batched), deleted by randomized deletion, batched (in the "
    "released batches), forwarded (in batches the analyzer acknowledged whole) (database)"
)


class ShufflerEvents:
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
    read in one snapshot (:meth:`shuffler.store.ContributionStore.ledger_by_cause`);
    ``health`` the per-channel health of the :data:`CHANNEL_EPOCHS` newest epochs."""

    def __init__(
        self, events: ShufflerEvents, ledger: Callable[[], Ledger], health: Health | None = None
    ) -> None:
        self.events = events
        self.ledger = ledger
        self.health = health

    def describe(self) -> Iterator[Any]:
        """The metric names, without reading the store: registration runs before the
        migrations, and ``collect`` would query tables that do not exist yet."""
        yield from self._counters()
        yield from self._gauges(({}, {}))
        if self.health is not None:
            yield from channel_families(())

    def collect(self) -> Iterator[Any]:
        """The counters, then the database's gauges (none while the store cannot be read)."""
        yield from self._counters()
        try:
            ledger = self.ledger()
        except SQLAlchemyError:
            return
        yield from self._gauges(ledger)
        if self.health is None:
            return
        try:
            health = self.health(CHANNEL_EPOCHS)
        except SQLAlchemyError:
            return
        yield from channel_families(health)

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
        # This process's store transactions by name and outcome (runtime.db.run_tx); the
        # batching ones are never counted (their counts follow group sizes).
        yield db.TRANSACTIONS.family("shuffler.")


def channel_families(health: Sequence[EpochGroups]) -> tuple[GaugeMetricFamily, ...]:
    """:data:`CHANNEL_GROUPS` and :data:`CHANNEL_CONTRIBUTIONS` for ``health`` (empty: the
    families alone). Labelled by channel and epoch; the sizes are the released groups' only."""
    groups = GaugeMetricFamily(CHANNEL_GROUPS, GROUPS_HELP, labels=["channel", "epoch", "outcome"])
    contributions = GaugeMetricFamily(
        CHANNEL_CONTRIBUTIONS, CONTRIBUTIONS_HELP, labels=["channel", "epoch", "stage"]
    )
    for row in health:
        epoch = str(row.epoch)
        outcomes = (row.released, row.held, row.aborted)
        for outcome, count in zip(OUTCOMES, outcomes, strict=True):
            groups.add_metric([row.channel_id, epoch, outcome], count)
        stages = (row.received, row.deleted, row.batched, row.forwarded)
        for stage, count in zip(STAGES, stages, strict=True):
            contributions.add_metric([row.channel_id, epoch, stage], count)
    return groups, contributions
