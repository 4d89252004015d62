"""The shuffler's ledger metrics: the contract between the shuffler's ``/metrics`` and
``esa loadtest``'s verification.

The shuffler (``shuffler.metrics``, ``shuffler.store``) reads its trust domain's ledger from the
database at scrape time and exposes it under these names; the load test's verification
(``services.tools.loadtest.verify``) reads the same names to check conservation. Both import
them from here (the load test may not import the shuffler), so neither can rename a gauge or a
cause alone.
"""

from __future__ import annotations

#: Every contribution the trust domain acknowledged, by where it is now (label ``state``);
#: the sum over the states is every contribution it ever acknowledged.
LEDGER_CONTRIBUTIONS = "esa_shuffler_ledger_contributions"
#: The trust domain's deletions by cause (label ``cause``: :data:`LEDGER_CAUSES`).
LEDGER_DELETED = "esa_shuffler_ledger_deleted"
#: Deletions conservation accounts for: ESA-revisited Algorithm 3's randomized deletion and
#: aborts, and the retention purge (also the causes of the shuffler's per-process counter
#: ``esa_shuffler_contributions_deleted_total``).
DELETION_CAUSES = ("randomized_deletion", "abort", "retention")
#: A purge of contributions acknowledged after their group was evaluated: the ledger reports
#: it, conservation counts it as lost.
LATE = "late"
#: Every cause of :data:`LEDGER_DELETED`.
LEDGER_CAUSES = (*DELETION_CAUSES, LATE)
