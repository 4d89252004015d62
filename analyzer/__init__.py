"""The analyzer: verify signed batches, open fragments, accumulate, release certified estimates
(docs/architecture.md).

Layers, each importing only those below it: :mod:`analyzer.app` (HTTP routers) →
:mod:`analyzer.service` (the facade) → :mod:`analyzer.intake`, :mod:`analyzer.releases`,
:mod:`analyzer.ledger`, :mod:`analyzer.config` → :mod:`analyzer.store` (the database: its
transactions, their queries in :mod:`analyzer.store_queries`, the schema in
:mod:`analyzer.tables`, the values in :mod:`analyzer.records`) and :mod:`analyzer.channels`
(mechanisms); refusals are :mod:`analyzer.errors`.
"""
