"""The privacy ledger: basic composition over releases, δ capped at 1, one row per release."""

from __future__ import annotations

import pytest

from analyzer.errors import UnknownChannelError
from analyzer.ledger import compose
from analyzer.store import StoredRelease
from common.wire import Bound

from .helpers import VALUES, build, make_batch


def _stored(index: int, eps: float, delta: float) -> StoredRelease:
    bound = Bound(
        method="test",
        eps=eps,
        delta=delta,
        neighbouring="add-remove",
        valid_regime=True,
        kind="certified",
        note="",
        inputs={},
    )
    return StoredRelease(index, index, index, 100, bound, float(index))


def test_composition_adds_eps_and_delta_and_caps_delta_at_one() -> None:
    rows = compose([_stored(1, 0.5, 0.4), _stored(2, 0.25, 0.4), _stored(3, 1.0, 0.4)])
    assert [r.cumulative_eps for r in rows] == [0.5, 0.75, 1.75]
    assert [r.cumulative_delta for r in rows] == pytest.approx([0.4, 0.8, 1.0])
    assert compose([]) == []


def test_every_release_is_one_ledger_row(database_url: str) -> None:
    layers = build(database_url)
    layers.intake.accept(*make_batch(VALUES))
    first = layers.releases.release("homepage", 7, 7)
    layers.releases.release("homepage", 7, 7)
    ledger = layers.ledger.ledger("homepage")
    assert [row.epochs for row in ledger.releases] == [(7, 7), (7, 7)]
    assert ledger.releases[0].eps == pytest.approx(first.certificate.eps)
    assert ledger.releases[1].cumulative_eps == pytest.approx(2 * first.certificate.eps)
    assert layers.events.get("releases") == 2
    with pytest.raises(UnknownChannelError):
        layers.ledger.ledger("elsewhere")
