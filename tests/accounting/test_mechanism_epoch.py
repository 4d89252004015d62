"""One epoch of a mechanism as its dominating pair (``mechanism_epoch``, ``Mechanism.epoch_pair``):
the pair ``esa account compose`` and the analyzer's ledger both compose."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from common.accounting import (
    BalcerCheuNoise,
    BinaryRR,
    BinaryRRSequence,
    KaryRR,
    LocalRandomizer,
    lifetime_for_mechanism,
)
from common.accounting.hockey_stick import ClonePair, eps_for_delta
from common.accounting.lifetime import _best_pair, _no_worse, mechanism_epoch
from common.mechanisms import get

CHANNELS = {
    "krappor": {"k": 16, "eps": 2.0},
    "krr": {"k": 20, "eps": 1.0},
    "longitudinal": {"d": 8, "k": 1, "eps": 4.0},
    "zsum": {"d": 8, "eps": 1.0, "delta": 1e-6, "n": 2000},
    "rfrag": {"k": 16, "eps_b": 3.0, "eps_f": 2.5, "tau": 3},
}


@pytest.mark.parametrize("name", sorted(CHANNELS))
def test_every_built_in_says_whether_it_has_a_pair(name: str) -> None:
    mechanism = get(name)
    params = mechanism.parse_params(CHANNELS[name])
    epoch = mechanism.epoch_pair(params, 3000, 1e-8)
    if name in ("zsum", "rfrag"):  # no dominating pair: the ledger composes the certificate
        assert epoch is None
        return
    assert epoch is not None and len(epoch.pairs) == 1 and epoch.certificates == ()
    assert epoch.pairs[0].n_others == 2999
    natural = "replacement" if name == "krr" else "removal"
    assert epoch.neighbouring == natural
    swapped = mechanism.epoch_pair(params, 3000, 1e-8, replacement=True)
    assert swapped is not None and swapped.neighbouring == "replacement"
    assert len(swapped.pairs) == (1 if name == "krr" else 2)
    deleted = mechanism.epoch_pair(params, 3000, 1e-8, deletion=(0.5, 1e-9))
    assert deleted is not None and deleted.neighbouring == "add-remove"
    assert deleted.pairs == swapped.pairs
    assert [(c.eps, c.delta, c.source) for c in deleted.certificates] == [(0.5, 1e-9, "esa-thm-v1")]


def test_the_mechanism_pairs_are_what_account_compose_composes() -> None:
    krappor = get("krappor")
    params = krappor.parse_params(CHANNELS["krappor"])
    crowds = [800, 1200, 1000]
    epochs = [krappor.epoch_pair(params, n, 1e-6 / 3) for n in crowds]
    direct = mechanism_epoch(BinaryRR(), 2.0, 800, 1e-6 / 3)
    assert epochs[0] == direct
    blanket = ClonePair(799, 2.0 / (math.exp(2.0) + 1.0), 2.0)
    assert direct is not None and direct.pairs == (blanket,)
    result = lifetime_for_mechanism(BinaryRR(), 2.0, crowds, 1e-6)
    assert result.pair_parts == 3 and result.neighbouring == "removal"


def _candidates(randomizer: LocalRandomizer, eps0: float, n: int) -> list[ClonePair]:
    wanted = randomizer.applicable(None)
    return [
        spec.pair(eps0, n)
        for spec in randomizer.methods()
        if spec.pair is not None and spec.method in wanted
    ]


@pytest.mark.parametrize(
    ("randomizer", "eps0", "n"),
    [
        (BinaryRR(), 2.0, 5000),
        (BinaryRR(), 0.3, 40),
        (BinaryRRSequence(), 4.0, 900),
        *[
            (KaryRR(k=k), eps0, n)
            for eps0, n, k in itertools.product((0.5, 1.0, 3.0), (50, 5000), (2, 20, 200))
        ],
    ],
    ids=str,
)
def test_the_chosen_pair_is_the_tightest_candidate(
    randomizer: LocalRandomizer, eps0: float, n: int
) -> None:
    delta = 1e-8
    best = _best_pair(randomizer, eps0, n, delta)
    assert best is not None
    tightest = min(eps_for_delta(pair, delta) for pair in _candidates(randomizer, eps0, n))
    assert eps_for_delta(best, delta) <= tightest + 1e-12


def test_a_pair_no_worse_than_another_has_no_larger_eps() -> None:
    rng = np.random.default_rng(13)
    checked = 0
    for _ in range(60):
        m = int(rng.integers(5, 400))
        r, eps0, weight = rng.uniform(0.01, 0.9), rng.uniform(0.2, 4.0), rng.uniform(0.3, 1.0)
        worse = ClonePair(m, float(r), float(eps0), float(weight))
        better = ClonePair(
            m + int(rng.integers(0, 50)),
            float(min(1.0, r * rng.uniform(1.0, 1.5))),
            float(eps0 * rng.uniform(0.7, 1.0)),
            float(weight * rng.uniform(0.7, 1.0)),
        )
        assert _no_worse(better, worse)
        for delta in (1e-3, 1e-6):
            assert eps_for_delta(better, delta) <= eps_for_delta(worse, delta) + 1e-9
            checked += 1
    assert checked == 120


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="crowd"):
        mechanism_epoch(BinaryRR(), 2.0, 0, 1e-6)
    with pytest.raises(ValueError, match="delta"):
        mechanism_epoch(BinaryRR(), 2.0, 100, 1.5)
    with pytest.raises(TypeError, match="randomizer='nope'"):
        mechanism_epoch("nope", 2.0, 100, 1e-6)  # type: ignore[arg-type]
    assert mechanism_epoch(BalcerCheuNoise(n_declared=100), 1.0, 100, 1e-6) is None
