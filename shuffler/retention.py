"""Retention (docs/protocol.md, "Delivery guarantees"): contributions still waiting, groups held
below the minimum crowd (Algorithm 3 never releases them) and undelivered batches older than
``retention_seconds`` are deleted, and the deletion is recorded so that every acknowledged
contribution stays accounted for (forwarded, deleted by Algorithm 3, or purged)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from shuffler.store import ContributionStore

log = logging.getLogger("esa.shuffler")


class Retention:
    """Deletes what outlived the retention period."""

    def __init__(
        self, store: ContributionStore, retention_seconds: float, clock: Callable[[], float]
    ) -> None:
        if not retention_seconds > 0:
            raise ValueError(f"retention_seconds must be > 0, got {retention_seconds}")
        self.store = store
        self.retention_seconds = retention_seconds
        self.clock = clock

    def purge(self) -> dict[str, int]:
        """Delete everything older than the retention period; returns contributions deleted
        by reason (``retention``; ``refused``: in batches the analyzer refused a part of)."""
        now = self.clock()
        removed = self.store.purge(now - self.retention_seconds, now)
        if removed["refused"]:
            log.warning(
                "retention purge: a batch the analyzer refused a part of was deleted (its "
                "contributions never reach a release; requeue such batches before retention)"
            )
        if removed["retention"]:
            # No count in the log: a purge may be one held group, whose size is secret
            # (Algorithm 3 never released it); the count is on the credentialed /metrics.
            log.info("retention purge: expired contributions deleted")
        return removed
