"""Grids over (n, ε0, δ): lower <= certified <= local ε, monotonicity, planner round trips."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest

from common.accounting import (
    BackstopFragments,
    BalcerCheuNoise,
    BinaryRR,
    BinaryRRSequence,
    GenericRandomizer,
    KaryRR,
    LocalRandomizer,
    blanket_binary_rr,
    certify,
    fmt21_clones,
    plan_eps0,
)
from common.accounting import shuffle_bounds as sb

NS = [10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000]
EPS0S = [0.1, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0]
DELTAS = [1e-4, 1e-6, 1e-9, 1e-12]
# Monotonicity is exact up to the stopping tolerance of the ε search (1e-10 relative).
SLACK = 1e-9


def non_increasing(values: Sequence[float]) -> bool:
    return all(b <= a * (1 + SLACK) for a, b in itertools.pairwise(values))


def non_decreasing(values: Sequence[float]) -> bool:
    return all(b >= a * (1 - SLACK) for a, b in itertools.pairwise(values))


@pytest.mark.parametrize("randomizer", [GenericRandomizer(), BinaryRR()], ids=str)
@pytest.mark.parametrize("delta", DELTAS)
def test_certified_between_lower_bound_and_local_eps(
    randomizer: LocalRandomizer, delta: float
) -> None:
    for n, eps0 in itertools.product(NS, EPS0S):
        cert = certify(randomizer, eps0, n, delta)
        assert cert.lower is not None
        assert cert.lower.eps <= cert.certified.eps * (1 + SLACK) + 1e-12, (n, eps0)
        assert cert.certified.eps <= eps0
        for bound in cert.bounds:
            if bound.certifiable:
                assert bound.eps >= cert.lower.eps * (1 - SLACK), (bound.method, n, eps0)


@pytest.mark.parametrize("bound_fn", [blanket_binary_rr, fmt21_clones], ids=["blanket", "clones"])
def test_numerical_bounds_monotone_in_n_eps0_delta(bound_fn: object) -> None:
    fn = bound_fn  # type: ignore[assignment]
    for eps0, delta in itertools.product(EPS0S, DELTAS):
        values = [fn(eps0, n, delta).eps for n in NS]  # type: ignore[operator]
        assert non_increasing(values), (eps0, delta, values)
    for n, delta in itertools.product(NS, DELTAS):
        values = [fn(eps0, n, delta).eps for eps0 in EPS0S]  # type: ignore[operator]
        assert non_decreasing(values), (n, delta, values)
    for n, eps0 in itertools.product(NS, EPS0S):
        values = [fn(eps0, n, delta).eps for delta in DELTAS]  # type: ignore[operator]
        assert non_decreasing(values), (n, eps0, values)


@pytest.mark.parametrize(
    "randomizer", [GenericRandomizer(), BinaryRR(), BinaryRRSequence()], ids=str
)
def test_certificate_monotone_in_n_eps0_delta(randomizer: LocalRandomizer) -> None:
    for eps0, delta in itertools.product(EPS0S, DELTAS[:3]):
        values = [certify(randomizer, eps0, n, delta).certified.eps for n in NS]
        assert non_increasing(values), (eps0, delta)
    for n, delta in itertools.product(NS, DELTAS[:3]):
        values = [certify(randomizer, eps0, n, delta).certified.eps for eps0 in EPS0S]
        assert non_decreasing(values), (n, delta)


PLAN_CASES = [
    (BinaryRR(), None, 1.0, 1e-9, 1_000_000),
    (BinaryRR(), "cheu-lemma-ii6", 0.5, 1e-8, 5_000_000),
    (GenericRandomizer(), None, 0.3, 1e-6, 100_000),
    (GenericRandomizer(), "fmt21-closed", 1.0, 1e-6, 100_000),
    (KaryRR(k=50), None, 1.0, 1e-7, 1_000_000),
    (BackstopFragments(eps_f=2.0, tau=16), None, 0.5, 1e-8, 2_000_000),
    (BinaryRRSequence(), None, 1.0, 1e-8, 100_000),
    (BalcerCheuNoise(), None, 1.0, 1e-6, 50_000),
]


@pytest.mark.parametrize(("randomizer", "bound", "target", "delta", "n"), PLAN_CASES, ids=str)
def test_planner_round_trip_and_maximality(
    randomizer: LocalRandomizer, bound: str | None, target: float, delta: float, n: int
) -> None:
    plan = plan_eps0(target, delta, n, randomizer, bound)
    methods = None if bound is None else [bound]
    at_plan = certify(randomizer, plan.eps0, n, delta, methods).certified
    assert at_plan.certifiable and at_plan.eps <= target
    assert not plan.capped
    just_above = certify(randomizer, plan.eps0 + 1e-3, n, delta, methods).certified
    assert not (just_above.certifiable and just_above.eps <= target)


def test_planner_flags_the_cap_when_every_eps0_certifies() -> None:
    plan = plan_eps0(0.5, 1e-8, 2_000_000, BackstopFragments(eps_f=2.0, tau=4))
    assert plan.capped and plan.eps0 == 50.0
    assert plan.certification.certified.eps <= 0.5


def test_planner_reports_every_method() -> None:
    plan = plan_eps0(1.0, 1e-9, 10**6, BinaryRR())
    methods = {m for m, _ in plan.per_method}
    assert sb.BLANKET_BINARY_RR in methods and sb.CHEU_LEMMA_II6 in methods
    assert plan.method == max((e or 0, m) for m, e in plan.per_method)[1]


def test_blanket_is_at_least_as_tight_as_generic_clones_for_binary_rr() -> None:
    for n, eps0 in itertools.product(NS, EPS0S):
        assert blanket_binary_rr(eps0, n, 1e-8).eps <= fmt21_clones(eps0, n, 1e-8).eps * (1 + SLACK)


def test_replacement_is_twice_removal_at_half_delta() -> None:
    cert = certify(BinaryRR(), 6.0, 10**6, 1e-8)
    half = certify(BinaryRR(), 6.0, 10**6, 5e-9).certified
    assert cert.other_notion.neighbouring == "replacement"
    assert cert.other_notion.eps == pytest.approx(2 * half.eps)
    assert cert.other_notion.delta == pytest.approx(1e-8)
    assert math.isfinite(cert.other_notion.eps)
