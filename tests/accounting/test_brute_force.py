"""Independent brute-force hockey-stick computations for small n (full enumeration).

The fast path evaluates Lemma E.1's closed form with scipy's incomplete beta over blocks of
clone counts; here we enumerate every (clone count, count of ones) pair with exact binomial
coefficients from ``math.comb`` and sum the divergence directly.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from common.accounting import blanket_binary_rr, blanket_krr, fmt21_clones, lower_2rr
from common.accounting.hockey_stick import ClonePair, delta_for_eps, search_right_end
from common.accounting.lower import two_rr_delta


def _binom_pmf(trials: int, p: float) -> list[float]:
    return [math.comb(trials, c) * p**c * (1.0 - p) ** (trials - c) for c in range(trials + 1)]


def brute_pair_delta(pair: ClonePair, eps: float) -> float:
    """Enumerate P, Q of FMT21 eq. (20) over all (a, c) and sum the hockey-stick terms."""
    q = math.exp(pair.eps0) / (math.exp(pair.eps0) + 1.0)
    factor = math.exp(eps)
    forward = backward = 0.0
    for c, weight in enumerate(_binom_pmf(pair.n_others, pair.clone_prob)):
        half = [math.comb(c, a) / 2.0**c for a in range(c + 1)]
        for a in range(c + 2):
            here = half[a] if a <= c else 0.0
            below = half[a - 1] if a >= 1 else 0.0
            p_val = weight * (q * here + (1 - q) * below)
            q_val = weight * ((1 - q) * here + q * below)
            forward += max(0.0, p_val - factor * q_val)
            backward += max(0.0, q_val - factor * p_val)
    return pair.weight * max(forward, backward)


PAIRS = [
    ClonePair(9, 2 / (math.e**1 + 1), 1.0),
    ClonePair(49, math.exp(-2.0), 2.0),
    ClonePair(199, 2 / (math.e**3 + 1), 3.0),
    ClonePair(199, math.exp(-0.5), 0.5),
    ClonePair(149, 2 / (math.exp(4.0) + 9), 4.0, weight=(math.exp(4.0) + 1) / (math.exp(4.0) + 9)),
]


@pytest.mark.parametrize(
    "pair", PAIRS, ids=lambda p: f"n{p.n_others + 1}-e{p.eps0:g}-w{p.weight:.2f}"
)
def test_delta_curve_matches_full_enumeration(pair: ClonePair) -> None:
    for fraction in (0.05, 0.2, 0.4, 0.7, 0.9):
        eps = fraction * pair.eps0
        brute = brute_pair_delta(pair, eps)
        if brute < 1e-12:
            continue
        assert delta_for_eps(pair, eps, 1e-9) == pytest.approx(brute, rel=1e-9)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"n{p.n_others + 1}-e{p.eps0:g}")
@pytest.mark.parametrize("delta", [1e-3, 1e-6])
def test_certified_eps_matches_full_enumeration(pair: ClonePair, delta: float) -> None:
    from common.accounting.hockey_stick import eps_for_delta

    brute = search_right_end(lambda e: brute_pair_delta(pair, e), pair.eps0, delta)
    assert eps_for_delta(pair, delta) == pytest.approx(brute, rel=1e-9)


def _exact_shuffled_rr_delta(n: int, ones_among_others: int, eps0: float, eps: float) -> float:
    """Exact divergence of the count of ones, target bit 0 vs 1, others fixed."""
    p = 1.0 / (math.exp(eps0) + 1.0)
    others = np.convolve(
        _binom_pmf(ones_among_others, 1.0 - p), _binom_pmf(n - 1 - ones_among_others, p)
    )
    zero = np.convolve(others, [1 - p, p])
    one = np.convolve(others, [p, 1 - p])
    factor = math.exp(eps)
    return float(
        max(np.maximum(zero - factor * one, 0).sum(), np.maximum(one - factor * zero, 0).sum())
    )


@pytest.mark.parametrize(
    ("n", "eps0", "delta"), [(20, 1.0, 1e-3), (100, 2.0, 1e-4), (200, 3.0, 1e-6)]
)
def test_blanket_certificate_holds_for_every_dataset(n: int, eps0: float, delta: float) -> None:
    """The certified ε is an upper bound: no neighbouring pair of binary datasets exceeds it."""
    certified = blanket_binary_rr(eps0, n, delta).eps
    worst = max(_exact_shuffled_rr_delta(n, m, eps0, certified) for m in range(n))
    assert worst <= delta * (1 + 1e-9)


def test_lower_bound_matches_convolution_and_sits_below_upper_bounds() -> None:
    n, eps0, delta = 150, 2.0, 1e-5
    for eps in (0.1, 0.5, 1.0):
        assert two_rr_delta(n, eps0, eps) == pytest.approx(
            _exact_shuffled_rr_delta(n, 0, eps0, eps), rel=1e-8
        )
    lower = lower_2rr(eps0, n, delta).eps
    assert lower <= blanket_binary_rr(eps0, n, delta).eps <= fmt21_clones(eps0, n, delta).eps
    assert _exact_shuffled_rr_delta(n, 0, eps0, lower) >= delta * (1 - 1e-9)


def test_krr_numerical_bound_holds_for_exact_krr() -> None:
    """Exact shuffled k-RR (k=3, n=30) histogram divergence never exceeds the certificate."""
    n, k, eps0, delta = 30, 3, 1.5, 1e-4
    certified = blanket_krr(eps0, n, delta, k).eps
    e0 = Fraction(math.exp(eps0))
    stay = float(e0 / (e0 + k - 1))
    move = float(1 / (e0 + k - 1))
    worst = 0.0
    # The others' values only matter through how many hold each symbol; try every split.
    for n0 in range(n):
        for n1 in range(n - n0):
            n2 = n - 1 - n0 - n1
            hist = _krr_histogram(n0, n1, n2, stay, move)
            with_0 = _add_target(hist, [stay, move, move])
            with_1 = _add_target(hist, [move, stay, move])
            factor = math.exp(certified)
            worst = max(worst, float(np.maximum(with_0 - factor * with_1, 0).sum()))
    assert worst <= delta * (1 + 1e-9)


def _krr_histogram(n0: int, n1: int, n2: int, stay: float, move: float) -> np.ndarray:
    size = n0 + n1 + n2 + 2
    dist = np.zeros((size, size))
    dist[0, 0] = 1.0
    for symbol, count in ((0, n0), (1, n1), (2, n2)):
        probs = [move, move, move]
        probs[symbol] = stay
        for _ in range(count):
            dist = _add_target(dist, probs)
    return dist


def _add_target(dist: np.ndarray, probs: list[float]) -> np.ndarray:
    """Add one report: counts of symbols 0 and 1 (symbol 2 is implied by the total)."""
    out = probs[2] * dist
    out[1:, :] += probs[0] * dist[:-1, :]
    out[:, 1:] += probs[1] * dist[:, :-1]
    return out


@pytest.mark.parametrize("offset_sigmas", [0.3, 2.0, 8.0])
def test_library_accuracy_at_huge_counts(offset_sigmas: float) -> None:
    """Boost's incomplete beta / pmf stay within LIBRARY_REL_ERROR at c ~ 5e8.

    Reference: F(m) = A(m) · Σ_j Π ratios, summed backwards with exact float ratios; A(m) from
    log-gamma in 40-digit arithmetic.
    """
    import mpmath
    from scipy import special, stats

    from common.accounting.hockey_stick import LIBRARY_REL_ERROR

    mpmath.mp.dps = 40
    c = 537_784_784
    m = int(c / 2 - offset_sigmas * math.sqrt(c) / 2)
    log_pmf = mpmath.loggamma(c + 1) - mpmath.loggamma(m + 1) - mpmath.loggamma(c - m + 1)
    pmf = float(mpmath.exp(log_pmf - c * mpmath.log(2)))
    a = np.arange(m, m - 600_000, -1, dtype=np.float64)
    logs = np.concatenate([[0.0], np.cumsum(np.log(a[:-1] / (c - a[:-1] + 1)))])
    cdf = pmf * math.fsum(np.exp(logs))
    assert float(stats.binom.pmf(m, c, 0.5)) == pytest.approx(pmf, rel=LIBRARY_REL_ERROR)
    assert float(special.betainc(c - m, m + 1, 0.5)) == pytest.approx(cdf, rel=LIBRARY_REL_ERROR)


@pytest.mark.parametrize(("n", "eps0", "eps"), [(10**9, 1.0, 1.2e-4), (10**7, 4.0, 0.015)])
def test_computed_divergence_is_non_increasing_on_the_grid(n: int, eps0: float, eps: float) -> None:
    """Lemma E.2 must survive floating point, or block coarse-graining is not an upper bound."""
    from common.accounting.hockey_stick import _blocks, clone_divergence

    blocks = _blocks(n - 1, 2.0 / (math.exp(eps0) + 1.0), 1e-18)
    values = clone_divergence(blocks.starts, eps, eps0)
    assert np.all(np.diff(values) <= 0.0)
