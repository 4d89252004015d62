"""Retention at the analyzer: the parts of a batch that never completes (its shuffler purged
the rest after the analyzer refused a part) are deleted once they outlive
``incomplete_retention_seconds``; complete batches and recent parts stay."""

from __future__ import annotations

import time

from common.wire import Batch

from .helpers import VALUES, build, estimated, make_batch, signed


def _first_of_two(epoch: int) -> Batch:
    """Part 0 of a two-part batch of reports (part 1 never comes)."""
    whole = Batch.model_validate_json(make_batch(VALUES, epoch=epoch).body)
    half = len(whole.fragments) // 2
    return whole.model_copy(update={"parts": 2, "fragments": whole.fragments[:half]})


def test_only_old_parts_of_batches_that_never_completed_are_purged(database_url: str) -> None:
    layers = build(database_url)
    layers.deliver(*make_batch(VALUES, epoch=7))  # complete
    layers.deliver(*signed(_first_of_two(8)))  # incomplete, old
    cutoff = time.time() + 0.001
    time.sleep(0.01)
    layers.deliver(*signed(_first_of_two(9)))  # incomplete, recent
    assert len(layers.store.incomplete("homepage", "", 0, 100)) == 2
    assert layers.store.purge_incomplete(cutoff) == 1
    left = layers.store.incomplete("homepage", "", 0, 100)
    assert [p.opened for p in left.values()] == [1]
    assert layers.releases.release("homepage", 7, 7).estimate.n == estimated(VALUES)
    assert layers.store.purge_incomplete(cutoff) == 0  # nothing more, nothing complete
