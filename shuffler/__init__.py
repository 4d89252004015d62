"""The shuffler: authenticate, store durably, batch with randomized deletion, shuffle, sign,
forward (ESA-revisited §V). Core logic in :mod:`shuffler.core`; :mod:`shuffler.app` is a thin
FastAPI layer over it."""
