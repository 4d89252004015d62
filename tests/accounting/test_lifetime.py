"""Lifetime accounting (common.accounting.lifetime) against independent computations.

* exact: the clone pair of FMT21 eq. (20) enumerated outcome by outcome with ``math.comb``,
  composed by product enumeration, δ(ε) = E_P[(1 - e^{ε - L})_+] summed exactly;
* direct: dp_accounting's generic ``from_two_probability_mass_functions`` on the exact pair;
* lower: the FMT21 Appendix F pair composed with optimistic estimates.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from common.accounting import (
    BackstopFragments,
    BalcerCheuNoise,
    BinaryRR,
    BinaryRRSequence,
    Certificate,
    Epoch,
    GenericRandomizer,
    KaryRR,
    LifetimeResult,
    LocalRandomizer,
    certify,
    compose_epochs,
    lifetime_for_mechanism,
    plan_eps0_lifetime,
)
from common.accounting.hockey_stick import ClonePair, eps_for_delta
from tests.accounting.direct_pld import direct_blanket_lifetime, lower_2rr_lifetime


def _blanket(n: int, eps0: float) -> ClonePair:
    return ClonePair(n - 1, 2.0 / (math.exp(eps0) + 1.0), eps0)


def _krr(n: int, eps0: float, k: int) -> ClonePair:
    e0 = math.exp(eps0)
    return ClonePair(n - 1, 2.0 / (e0 + k - 1.0), eps0, weight=(e0 + 1.0) / (e0 + k - 1.0))


def exact_atoms(pair: ClonePair, swap: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(loss, P-mass) of every outcome (x, c) of the pair; ``swap`` gives Q's view."""
    q = math.exp(pair.eps0) / (math.exp(pair.eps0) + 1.0)
    losses, masses = [], []
    m, r = pair.n_others, pair.clone_prob
    for c in range(m + 1):
        weight = math.comb(m, c) * r**c * (1.0 - r) ** (m - c)
        for x in range(c + 2):
            here = math.comb(c, x) / 2.0**c if x <= c else 0.0
            below = math.comb(c, x - 1) / 2.0**c if x >= 1 else 0.0
            p_val = q * here + (1.0 - q) * below
            q_val = (1.0 - q) * here + q * below
            if swap:
                p_val, q_val = q_val, p_val
            if weight * p_val > 0.0:
                losses.append(math.log(p_val / q_val))
                masses.append(pair.weight * weight * p_val)
    if pair.weight < 1.0:
        losses.append(0.0)
        masses.append(1.0 - pair.weight)
    return np.array(losses), np.array(masses)


def exact_composed_eps(pairs: list[ClonePair], delta: float) -> float:
    """Exact ε at δ of the product of the pairs (product enumeration, bisection on ε)."""
    losses, masses = np.zeros(1), np.ones(1)
    for pair in pairs:
        more_losses, more_masses = exact_atoms(pair)
        losses = (losses[:, None] + more_losses[None, :]).ravel()
        masses = (masses[:, None] * more_masses[None, :]).ravel()

    def delta_at(eps: float) -> float:
        above = losses > eps
        return float(np.dot(masses[above], -np.expm1(eps - losses[above])))

    lo, hi = 0.0, sum(p.eps0 for p in pairs)
    if delta_at(lo) <= delta:
        return 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if delta_at(mid) <= delta else (mid, hi)
    return hi


EXACT_CASES = [
    ([_blanket(30, 1.0)] * 2, 1e-3),
    ([_blanket(30, 2.0)] * 2, 1e-4),
    ([_blanket(12, 3.0)] * 3, 1e-3),
    ([_blanket(6, 1.5)] * 4, 1e-2),
    ([ClonePair(29, math.exp(-2.0), 2.0)] * 2, 1e-3),
    ([ClonePair(11, math.exp(-1.0), 1.0)] * 3, 1e-4),
    ([_krr(25, 3.0, 5)] * 2, 1e-3),
    ([_blanket(30, 2.0), _blanket(12, 2.0), _blanket(8, 2.0)], 1e-3),
    (
        [_blanket(8, 1.0), ClonePair(7, math.exp(-3.0), 3.0), _krr(9, 2.0, 4), _blanket(5, 0.5)],
        1e-3,
    ),
]


@pytest.mark.parametrize("case", range(len(EXACT_CASES)))
def test_pld_is_an_upper_bound_close_to_the_exact_composition(case: int) -> None:
    pairs, delta = EXACT_CASES[case]
    exact = exact_composed_eps(pairs, delta)
    result = compose_epochs([Epoch.from_pair(p) for p in pairs], delta)
    assert result.eps_pld >= exact - 1e-12
    assert result.eps_pld <= 1.02 * exact + 0.005
    assert result.eps <= result.eps_pld


@pytest.mark.parametrize("pair", [_blanket(15, 2.0), _krr(12, 2.5, 6), ClonePair(9, 0.3, 1.0)])
def test_pair_is_symmetric_so_one_pld_covers_both_directions(pair: ClonePair) -> None:
    forward = sorted(zip(*exact_atoms(pair), strict=True))
    backward = sorted(zip(*exact_atoms(pair, swap=True), strict=True))
    assert np.allclose(np.array(forward), np.array(backward), rtol=1e-12, atol=1e-15)


GRID = [
    (BinaryRR(), 1.0, 1000, 5),
    (BinaryRR(), 4.0, 20_000, 30),
    (GenericRandomizer(), 2.0, 10_000, 12),
    (BinaryRRSequence(), 3.0, 5000, 8),
    (KaryRR(k=8), 3.0, 3000, 20),
    (BackstopFragments(eps_f=1.0, tau=3), 2.0, 4000, 6),
]


@pytest.mark.parametrize(("randomizer", "eps0", "n", "epochs"), GRID, ids=str)
def test_reported_eps_is_the_best_of_pld_basic_and_advanced(
    randomizer: LocalRandomizer, eps0: float, n: int, epochs: int
) -> None:
    result = lifetime_for_mechanism(randomizer, eps0, [n] * epochs, 1e-6)
    assert result.eps == min(result.eps_pld, result.eps_basic, result.eps_advanced)
    assert result.eps <= result.eps_basic and result.eps <= result.eps_advanced
    assert result.epochs == epochs and result.parts == epochs
    split = result.delta_split
    assert split.basic_per_part * epochs <= 1e-6 * (1 + 1e-12)
    assert split.advanced_per_step * epochs + split.advanced_slack <= 1e-6 * (1 + 1e-12)
    assert 0.0 < split.pld_truncation <= 1e-6 * 1e-5


@pytest.mark.parametrize(
    ("eps0", "n", "epochs"), [(1.0, 500, 4), (2.0, 5000, 365), (4.0, 50_000, 50)]
)
def test_never_below_the_composed_2rr_lower_bound(eps0: float, n: int, epochs: int) -> None:
    delta = 1e-5
    upper = lifetime_for_mechanism(BinaryRR(), eps0, [n] * epochs, delta)
    assert upper.eps >= lower_2rr_lifetime(n, eps0, epochs, delta)


def test_reference_example_one_year_of_krappor_at_5000() -> None:
    """Issue 13: n = 5,000, ε0 = 2, 365 epochs, δ = 1e-5."""
    one_epoch = eps_for_delta(_blanket(5000, 2.0), 1e-8)
    assert one_epoch == pytest.approx(0.21, abs=0.005)
    issue_basic = 365 * one_epoch
    assert issue_basic == pytest.approx(76.7, rel=0.01)
    result = lifetime_for_mechanism(BinaryRR(), 2.0, [5000] * 365, 1e-5)
    assert result.eps_basic <= issue_basic
    assert result.method == "pld" and result.eps == result.eps_pld
    assert result.eps <= issue_basic / 10.0
    assert result.eps == pytest.approx(3.6, abs=0.1)
    direct = direct_blanket_lifetime(5000, 2.0, 365, 1e-5)
    assert result.eps == pytest.approx(direct, rel=0.10)


def test_a_million_per_epoch_for_a_year_is_fast_and_tighter() -> None:
    big = lifetime_for_mechanism(BinaryRR(), 2.0, [10**6] * 365, 1e-5)
    small = lifetime_for_mechanism(BinaryRR(), 2.0, [5000] * 365, 1e-5)
    assert big.eps < small.eps / 10.0
    assert big.eps >= lower_2rr_lifetime(10**6, 2.0, 365, 1e-5)


def test_mixed_crowds_sit_between_the_uniform_ones() -> None:
    crowds = [5000, 4000, 3000, 2500] * 5
    mixed = lifetime_for_mechanism(BinaryRR(), 2.0, crowds, 1e-6)
    largest = lifetime_for_mechanism(BinaryRR(), 2.0, [5000] * 20, 1e-6)
    smallest = lifetime_for_mechanism(BinaryRR(), 2.0, [2500] * 20, 1e-6)
    assert largest.eps_pld <= mixed.eps_pld <= smallest.eps_pld
    assert mixed.epochs == 20


def exact_certificates_eps(eps: float, delta: float, k: int, target: float) -> float:
    """k-fold composition of the canonical (ε, δ) pair, exactly (Kairouz et al. 2015)."""
    p = math.exp(eps) / (1.0 + math.exp(eps))
    ups = np.arange(k + 1)
    weights = np.array([math.comb(k, j) * p**j * (1 - p) ** (k - j) for j in ups])
    losses = eps * (2 * ups - k)
    clean = (1.0 - delta) ** k

    def delta_at(e: float) -> float:
        above = losses > e
        return 1.0 - clean + clean * float(np.dot(weights[above], -np.expm1(e - losses[above])))

    lo, hi = 0.0, k * eps
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if delta_at(mid) <= target else (mid, hi)
    return hi


def test_certificates_only() -> None:
    epochs = [Epoch.from_certificate(0.1, 1e-9)] * 100
    result = compose_epochs(epochs, 1e-6)
    assert result.eps_basic == pytest.approx(10.0)
    assert result.method == "pld" and result.eps < result.eps_advanced < result.eps_basic
    assert result.delta_split.certificates == pytest.approx(1e-7)
    exact = exact_certificates_eps(0.1, 1e-9, 100, 1e-6)
    assert exact - 1e-9 <= result.eps <= 1.01 * exact
    one = compose_epochs([Epoch.from_certificate(0.5, 1e-8)], 1e-6)
    assert 0.5 - 1e-3 <= one.eps_pld <= 0.5 + one.discretization
    assert one.eps <= 0.5


def test_zsum_enters_as_its_certificate_and_infinity_is_no_bound() -> None:
    params = BalcerCheuNoise(n_declared=10_000)
    result = lifetime_for_mechanism(params, 1.0, [10_000] * 4, 1e-6)
    assert result.delta_split.certificates == pytest.approx(0.5e-6)
    per_epoch = certify(params, 1.0, 10_000, 0.5e-6 / 4).certified
    assert result.eps_basic == pytest.approx(4 * per_epoch.eps)
    assert result.neighbouring == "replacement"
    assert result.eps <= result.eps_basic
    nothing = lifetime_for_mechanism(params, 1.0, [100] * 4, 1e-6)
    assert math.isinf(nothing.eps) and nothing.as_dict()["eps"] is None


def test_pairs_and_certificates_mix() -> None:
    pairs = [Epoch.from_pair(_blanket(5000, 2.0))] * 10
    certs = [Epoch.from_certificate(0.2, 1e-8)] * 5
    result = compose_epochs(pairs + certs, 1e-6)
    only_pairs = compose_epochs(pairs, 1e-6)
    assert only_pairs.eps_pld < result.eps_pld <= only_pairs.eps_pld + 1.0 + 1e-3
    assert result.parts == 15


def test_randomized_deletion_is_an_add_remove_statement() -> None:
    plain = lifetime_for_mechanism(BinaryRR(), 2.0, [5000] * 10, 1e-6)
    deleted = lifetime_for_mechanism(BinaryRR(), 2.0, [5000] * 10, 1e-6, deletion=(0.1, 1e-8))
    assert deleted.neighbouring == "add-remove" and plain.neighbouring == "removal"
    assert deleted.parts == 30
    assert deleted.delta_split.certificates == pytest.approx(1e-7)
    assert deleted.eps > plain.eps
    with pytest.raises(ValueError, match="replacement"):
        Epoch.from_pair(_blanket(100, 1.0)).with_deletion(0.1, 1e-8)


def test_lifetime_grows_with_eps0() -> None:
    values = [
        lifetime_for_mechanism(BinaryRR(), e, [3000] * 20, 1e-6).eps for e in (0.5, 1, 2, 3, 4)
    ]
    assert values == sorted(values)


def test_planner_round_trip() -> None:
    target, delta, n, epochs = 1.0, 1e-6, 1000, 4
    eps0 = plan_eps0_lifetime(target, delta, n, epochs, BinaryRR())
    assert lifetime_for_mechanism(BinaryRR(), eps0, [n] * epochs, delta).eps <= target
    above = lifetime_for_mechanism(BinaryRR(), eps0 + 0.01, [n] * epochs, delta)
    assert above.eps > target


def test_json_form() -> None:
    result = lifetime_for_mechanism(BinaryRR(), 2.0, [5000] * 3, 1e-6)
    data = result.as_dict()
    assert isinstance(result, LifetimeResult)
    assert data["eps"] == result.eps and data["method"] == result.method
    assert set(data["delta_split"]) >= {"certificates", "pld_pairs", "basic_per_part"}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: compose_epochs([], 1e-6), "epochs="),
        (lambda: compose_epochs([Epoch.from_certificate(1.0, 1e-6)], 2.0), "delta=2.0"),
        (lambda: compose_epochs([Epoch.from_certificate(1.0, 1e-6)], 1e-6), "delta=1e-06"),
        (lambda: Epoch(), "pairs=()"),
        (lambda: Certificate(-1.0, 1e-6), "eps=-1.0"),
        (lambda: Certificate(1.0, 1.5), "delta=1.5"),
        (lambda: Certificate(float("nan"), 0.0), "eps=nan"),
        (lambda: lifetime_for_mechanism(BinaryRR(), 2.0, [0], 1e-6), "crowd=0"),
        (lambda: lifetime_for_mechanism(BinaryRR(), 2.0, [], 1e-6), "crowds=[]"),
        (lambda: lifetime_for_mechanism(BinaryRR(), float("nan"), [10], 1e-6), "eps0=nan"),
        (lambda: KaryRR(k=None), "k=None"),  # type: ignore[arg-type]
        (
            lambda: lifetime_for_mechanism(BinaryRR(), 2.0, [10] * 3, 1e-6, deletion=(0.1, 1e-6)),
            "delta_cr=1e-06",
        ),
        (lambda: plan_eps0_lifetime(0.0, 1e-6, 100, 3, BinaryRR()), "target_eps=0.0"),
        (lambda: plan_eps0_lifetime(1.0, 1e-6, 100, 0, BinaryRR()), "epochs=0"),
        (
            lambda: compose_epochs(
                [Epoch.from_certificate(1.0, 0.0), Epoch.from_certificate(1.0, 0.0, "replacement")],
                1e-6,
            ),
            "neighbouring",
        ),
    ],
)
def test_bad_arguments_name_the_value(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()  # type: ignore[operator]
