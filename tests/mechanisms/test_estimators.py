"""Unbiasedness, variance and per-report vs aggregate agreement for every mechanism.

docs/mechanisms.md, "Accuracy the tests hold": on seeded populations, the mean estimate over
>= 200 runs is within 4 standard errors of the truth and the empirical variance is within 15%
of the variance the module reports, both through the per-report path (small n) and through
``simulate_aggregate`` (large n); the two paths agree in distribution (two-sample KS test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from common.mechanisms import SeededSource, krappor, krr, rfrag, zsum
from common.mechanisms._estimates import CountAccumulator, Estimate
from common.mechanisms.device import BatchContext

RUNS = 200
SMALL = np.array([120, 80, 50, 30, 20, 0, 0, 0], dtype=np.int64)


@dataclass(frozen=True)
class Case:
    name: str
    report: Callable[[int, SeededSource], list[bytes]]
    empty: Callable[[], CountAccumulator]
    add: Callable[[CountAccumulator, list[bytes], int], int]
    estimate: Callable[[CountAccumulator], Estimate]
    simulate: Callable[[np.ndarray, np.random.Generator], CountAccumulator]
    variance: Callable[[np.ndarray], np.ndarray]
    checked: np.ndarray  # bins where the estimator is unbiased (zsum truncates small counts)


def _krappor() -> Case:
    p = krappor.KRapporParams(k=8, eps=1.5)
    return Case(
        name="krappor",
        report=lambda v, rng: krappor.KRappor().encode_value(p, v, rng),
        empty=lambda: krappor.KRappor().new_accumulator(p),
        add=lambda acc, frags, n: krappor.KRappor().accumulate(
            p, acc, frags, n, BatchContext(0, 1)
        ),
        estimate=lambda acc: krappor.KRappor().estimate(p, acc),
        simulate=lambda c, g: krappor.simulate_aggregate(c, p, g),
        variance=lambda c: np.full(c.size, krappor.variance(int(c.sum()), p)),
        checked=np.arange(8),
    )


def _krr() -> Case:
    p = krr.KRRParams(k=8, eps=2.0)
    return Case(
        name="krr",
        report=lambda v, rng: krr.KRR().encode_value(p, v, rng),
        empty=lambda: krr.KRR().new_accumulator(p),
        add=lambda acc, frags, n: krr.KRR().accumulate(p, acc, frags, n, BatchContext(0, 1)),
        estimate=lambda acc: krr.KRR().estimate(p, acc),
        simulate=lambda c, g: krr.simulate_aggregate(c, p, g),
        variance=lambda c: krr.variance(c, int(c.sum()), p),
        checked=np.arange(8),
    )


def _rfrag() -> Case:
    p = rfrag.RFragParams(k=8, eps_b=2.0, eps_f=1.0, tau=4)

    def report(v: int, rng: SeededSource) -> list[bytes]:
        rows = rfrag.RFrag().encode_rows(p, v, rfrag.new_state(p), rng)
        return [f for row in rows for f in row]

    return Case(
        name="rfrag",
        report=report,
        empty=lambda: rfrag.RFrag().new_accumulator(p),
        add=lambda acc, frags, n: rfrag.RFrag().accumulate(p, acc, frags, n, BatchContext(0, 1)),
        estimate=lambda acc: rfrag.RFrag().estimate(p, acc),
        simulate=lambda c, g: rfrag.simulate_aggregate(c, p, g),
        variance=lambda c: np.full(c.size, rfrag.variance(int(c.sum()), p)),
        checked=np.arange(8),
    )


ZSUM_SMALL = np.array([360, 160, 50, 30, 0, 0, 0, 0], dtype=np.int64)


def _zsum(counts: np.ndarray) -> Case:
    n = int(counts.sum())
    p = zsum.ZSumParams(d=8, eps=1.0, delta=0.5, n=n)
    return Case(
        name="zsum",
        report=lambda v, rng: zsum.ZSum().encode_value(p, v, rng),
        empty=lambda: zsum.ZSum().new_accumulator(p),
        add=lambda acc, frags, m: zsum.ZSum().accumulate(p, acc, frags, m, BatchContext(0, 1)),
        estimate=lambda acc: zsum.ZSum().estimate(p, acc),
        simulate=lambda c, g: zsum.simulate_aggregate(c, p, g),
        variance=lambda c: np.full(c.size, zsum.variance(int(c.sum()), p)),
        checked=np.arange(8),  # the release is unbiased in every bin, small and empty ones too
    )


CASES = {"krappor": _krappor, "krr": _krr, "rfrag": _rfrag}
#: The cases, rfrag's (~2 s each: τ fragments per report) in the slow tier.
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n == "rfrag" else n for n in sorted(CASES)]


def _per_report_runs(case: Case, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = np.repeat(np.arange(counts.size), counts)
    estimates, sums = [], []
    for run in range(RUNS):
        rng = SeededSource(10_000 + run)
        acc = case.empty()
        fragments = [f for v in values for f in case.report(int(v), rng)]
        assert case.add(acc, fragments, int(counts.sum())) == 0
        estimates.append(case.estimate(acc).values)
        sums.append(acc.counts.copy())
    return np.array(estimates), np.array(sums)


def _aggregate_runs(case: Case, counts: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    accs = [case.simulate(counts, gen) for _ in range(RUNS)]
    return np.array([case.estimate(a).values for a in accs]), np.array([a.counts for a in accs])


def _check_unbiased_and_variance(case: Case, counts: np.ndarray, estimates: np.ndarray) -> None:
    variance = case.variance(counts)
    bins = case.checked
    mean_error = estimates.mean(axis=0)[bins] - counts[bins]
    assert np.all(np.abs(mean_error) <= 4 * np.sqrt(variance[bins] / RUNS)), mean_error
    ratio = estimates.var(axis=0, ddof=1)[bins].mean() / variance[bins].mean()
    assert abs(ratio - 1) <= 0.15, ratio


@pytest.mark.parametrize("name", NAMES)
def test_per_report_path_unbiased_with_reported_variance(name: str) -> None:
    case = CASES[name]()
    estimates, _ = _per_report_runs(case, SMALL)
    _check_unbiased_and_variance(case, SMALL, estimates)


@pytest.mark.parametrize("name", sorted(CASES))
def test_aggregate_path_unbiased_at_large_n(name: str) -> None:
    case = CASES[name]()
    counts = SMALL * 25_000
    estimates, _ = _aggregate_runs(case, counts, seed=7)
    _check_unbiased_and_variance(case, counts, estimates)


@pytest.mark.parametrize("name", NAMES)
def test_per_report_and_aggregate_paths_agree_in_distribution(name: str) -> None:
    case = CASES[name]()
    _, per_report = _per_report_runs(case, SMALL)
    _, aggregate = _aggregate_runs(case, SMALL, seed=11)
    for j in (0, 3, 6):
        assert stats.ks_2samp(per_report[:, j], aggregate[:, j]).pvalue > 1e-3, j


def test_zsum_paths() -> None:
    case = _zsum(ZSUM_SMALL)
    estimates, per_report = _per_report_runs(case, ZSUM_SMALL)
    _check_unbiased_and_variance(case, ZSUM_SMALL, estimates)
    _, aggregate = _aggregate_runs(case, ZSUM_SMALL, seed=3)
    assert stats.ks_2samp(per_report[:, 0], aggregate[:, 0]).pvalue > 1e-3
    large = SMALL * 1000
    big_estimates, _ = _aggregate_runs(_zsum(large), large, seed=5)
    _check_unbiased_and_variance(_zsum(large), large, big_estimates)


def test_zsum_keeps_figure_1s_truncated_estimate_beside_the_unbiased_one() -> None:
    """Figure 1 zeroes every bin at or below the crowd: empty bins come out exactly 0, and so
    do small true counts (the bias the release's unbiased values do not have)."""
    params = zsum.ZSumParams(d=8, eps=1.0, delta=1e-6, n=4000)
    counts = np.array([3000, 1500, 400, 100, 0, 0, 0, 0], dtype=np.int64)
    gen = np.random.default_rng(2)
    truncated, unbiased = [], []
    for _ in range(RUNS):
        found = zsum.ZSum().estimate(params, zsum.simulate_aggregate(counts, params, gen))
        assert found.truncated is not None and not found.clipped
        kept = found.truncated != 0
        assert np.array_equal(found.truncated[kept], found.values[kept])
        truncated.append(found.truncated)
        unbiased.append(found.values)
    threshold = counts.sum() * (1 - params.noise_prob)  # m (1 - p) = 950 users
    assert np.all(np.array(truncated)[:, counts < threshold - 300] == 0.0)
    sd = np.sqrt(zsum.variance(int(counts.sum()), params) / RUNS)
    assert np.all(np.abs(np.mean(unbiased, axis=0) - counts) <= 4 * sd)
