"""The analyzer: verify signed batches, open fragments, accumulate, release certified estimates
(ARCHITECTURE.md). Core logic in :mod:`analyzer.core`."""
