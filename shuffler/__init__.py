"""The shuffler: authenticate, store durably, batch with randomized deletion, shuffle, sign,
forward (ESA-revisited §V, Algorithm 3).

Layers, each importing only those below it: :mod:`~shuffler.app` (ASGI: routes, the ingest fast
path, background loops) → :mod:`~shuffler.service` (the facade) → :mod:`~shuffler.intake`,
:mod:`~shuffler.forwarder`, :mod:`~shuffler.retention` → :mod:`~shuffler.store` (all SQL:
the transactions, their one-transaction queries in :mod:`~shuffler.store_queries`, one
implementation per dialect in :mod:`~shuffler.store_backends`) → :mod:`~shuffler.batcher`
(pure Algorithm 3 and shuffle) → :mod:`~shuffler.records`; refusals are :mod:`~shuffler.errors`."""
