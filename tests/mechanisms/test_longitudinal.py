"""Erlingsson et al. 2019 Algorithms 1–2: timing, unbiasedness with L levels, k cap."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from common.mechanisms import SeededSource, longitudinal
from common.mechanisms.device import BatchContext
from common.mechanisms.longitudinal import ChangeLog, LongitudinalParams
from services.tools import populations

PARAMS = LongitudinalParams(d=8, k=2, eps=2.0)
RUNS = 200


def _report_times(changes: dict[int, int], seed: int) -> list[int]:
    rng = SeededSource(seed)
    state = longitudinal.setup(PARAMS, rng)
    times = []
    for t in range(1, PARAMS.d + 1):
        state, report = longitudinal.update(state, t, changes.get(t, 0), PARAMS, rng)
        if report is not None:
            times.append(t)
    return times


def test_report_times_do_not_depend_on_data() -> None:
    for seed in range(50):
        assert _report_times({}, seed) == _report_times({2: 1, 5: -1}, seed)
        assert _report_times({1: 1}, seed) == _report_times({8: 1}, seed)


def _run_clients(log: ChangeLog, seed: int) -> longitudinal.TreeAccumulator:
    acc = longitudinal.Longitudinal().new_accumulator(PARAMS)
    by_user: dict[int, dict[int, int]] = {}
    for user, period, sign in zip(log.user, log.period, log.sign, strict=True):
        by_user.setdefault(int(user), {})[int(period)] = int(sign)
    rng = SeededSource(seed)
    reports = []
    for user in range(log.n_users):
        state = longitudinal.setup(PARAMS, rng)
        changes = by_user.get(user, {})
        for t in range(1, PARAMS.d + 1):
            state, report = longitudinal.update(state, t, changes.get(t, 0), PARAMS, rng)
            if report is not None:
                reports.append(report)
    assert longitudinal.Longitudinal().accumulate(PARAMS, acc, reports, 0, BatchContext(0, 1)) == 0
    return acc


def _check(estimates: np.ndarray, stds: np.ndarray, truth: np.ndarray) -> None:
    se = stds / np.sqrt(RUNS)
    assert np.all(np.abs(estimates.mean(axis=0) - truth) <= 4 * se)
    ratio = estimates.var(axis=0, ddof=1).mean() / (stds**2).mean()
    assert abs(ratio - 1) <= 0.15, ratio


def test_per_report_path_unbiased_with_l_levels() -> None:
    log = populations.longitudinal(300, PARAMS.d, PARAMS.k, seed=1).changes
    results = [
        longitudinal.Longitudinal().estimate(PARAMS, _run_clients(log, 500 + r))
        for r in range(RUNS)
    ]
    estimates = np.array([e.values for e in results])
    stds = np.array([e.std_errors for e in results]).mean(axis=0)
    _check(estimates, stds, log.true_counts())
    assert PARAMS.levels == 4


@pytest.mark.slow
def test_aggregate_path_unbiased_and_agrees_with_per_report_path() -> None:
    big = populations.longitudinal(200_000, PARAMS.d, PARAMS.k, seed=2).changes
    gen = np.random.default_rng(3)
    results = [
        longitudinal.Longitudinal().estimate(
            PARAMS, longitudinal.simulate_aggregate(big, PARAMS, gen)
        )
        for _ in range(RUNS)
    ]
    estimates = np.array([e.values for e in results])
    stds = np.array([e.std_errors for e in results]).mean(axis=0)
    _check(estimates, stds, big.true_counts())
    small = populations.longitudinal(300, PARAMS.d, PARAMS.k, seed=1).changes
    per_report = [
        longitudinal.Longitudinal().estimate(PARAMS, _run_clients(small, 900 + r)).values[5]
        for r in range(RUNS)
    ]
    aggregate = [
        longitudinal.Longitudinal()
        .estimate(PARAMS, longitudinal.simulate_aggregate(small, PARAMS, gen))
        .values[5]
        for _ in range(RUNS)
    ]
    assert stats.ks_2samp(per_report, aggregate).pvalue > 1e-3


@pytest.mark.slow
def test_changes_beyond_k_are_ignored() -> None:
    pop = populations.longitudinal(100_000, PARAMS.d, PARAMS.k, seed=4, over_k=1.0).changes
    order = np.lexsort((pop.period, pop.user))
    user, period, sign = pop.user[order], pop.period[order], pop.sign[order]
    first = np.r_[True, user[1:] != user[:-1]]
    rank = np.arange(user.size) - np.maximum.accumulate(np.where(first, np.arange(user.size), 0))
    kept = rank < PARAMS.k
    capped = ChangeLog(
        n_users=pop.n_users, d=pop.d, user=user[kept], period=period[kept], sign=sign[kept]
    )
    gen = np.random.default_rng(5)
    estimates = np.array(
        [
            longitudinal.Longitudinal()
            .estimate(PARAMS, longitudinal.simulate_aggregate(pop, PARAMS, gen))
            .values
            for _ in range(RUNS)
        ]
    )
    se = (
        longitudinal.Longitudinal()
        .estimate(PARAMS, longitudinal.simulate_aggregate(pop, PARAMS, gen))
        .std_errors
    )
    assert np.all(np.abs(estimates.mean(axis=0) - capped.true_counts()) <= 4 * se / np.sqrt(RUNS))
    assert np.any(capped.true_counts() != pop.true_counts())


def test_client_ignores_changes_beyond_k() -> None:
    state = longitudinal.TreeState(kappa_star=2, h_star=1)
    rng = SeededSource(0)
    state, _ = longitudinal.update(state, 1, 1, PARAMS, rng)
    state, _ = longitudinal.update(state, 2, -1, PARAMS, rng)
    assert state.c == 0 and state.kappa == 2
    state, _ = longitudinal.update(state, 3, 1, PARAMS, rng)
    assert state.c == 0 and state.kappa == 3
