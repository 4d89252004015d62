"""Conservation metrics: the contract between the services' ``/metrics`` and ``esa loadtest``'s
verification.

The shuffler (``shuffler.metrics``, ``shuffler.store``) reads its trust domain's ledger from the
database at scrape time and exposes it under these names, and the analyzer its fragments in
opened parts (``analyzer.metrics``); the load test's verification
(``services.tools.loadtest.verify``) reads the same names to check conservation. All import
them from here (the load test may not import a service), so none can rename a gauge or a
cause alone. Read from the database, they are the same at every replica or worker.
"""

from __future__ import annotations

#: Every contribution the trust domain acknowledged, by where it is now (label ``state``);
#: the sum over the states is every contribution it ever acknowledged.
LEDGER_CONTRIBUTIONS = "esa_shuffler_ledger_contributions"
#: The trust domain's deletions by cause (label ``cause``: :data:`LEDGER_CAUSES`).
LEDGER_DELETED = "esa_shuffler_ledger_deleted"
#: Deletions conservation accounts for: ESA-revisited Algorithm 3's randomized deletion and
#: aborts, the retention purge, and the purge of batches the analyzer refused a part of (also
#: the causes of the shuffler's per-process counter ``esa_shuffler_contributions_deleted_total``).
DELETION_CAUSES = ("randomized_deletion", "abort", "retention", "refused")
#: A purge of contributions acknowledged after their group was evaluated: the ledger reports
#: it, conservation counts it as lost.
LATE = "late"
#: Every cause of :data:`LEDGER_DELETED`.
LEDGER_CAUSES = (*DELETION_CAUSES, LATE)
#: The analyzer's fragments in every part opened by any of its workers (labels ``channel``,
#: ``state``: :data:`FRAGMENT_STATES`).
ANALYZER_FRAGMENTS = "esa_analyzer_ledger_fragments"
#: ``opened``: decrypted; ``invalid``: failed to open or parse.
FRAGMENT_STATES = ("opened", "invalid")
