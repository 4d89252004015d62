"""Composition rules, subsampling, deletion, conversions and Theorem IV.1 local ε."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from common.accounting import (
    BinaryRR,
    advanced_composition_bun_steinke,
    advanced_composition_drv,
    basic_composition,
    best_composition,
    certify,
    compose_with_deletion,
    composed_randomizer_eps,
    deletion_offset,
    deletion_utility_bound,
    esa_thm_iv1,
    fragment_eps,
    removal_to_replacement,
    replacement_to_removal,
    subsample,
)


def test_basic_composition_sums() -> None:
    out = basic_composition([(0.5, 1e-6), (0.25, 2e-6)])
    assert out.eps == pytest.approx(0.75) and out.delta == pytest.approx(3e-6)
    with pytest.raises(ValueError, match="parts"):
        basic_composition([])


def test_advanced_composition_formulas() -> None:
    drv = advanced_composition_drv(0.1, 1e-8, 100, 1e-6)
    expected = 0.1 * math.sqrt(200 * math.log(1e6)) + 100 * 0.1 * math.expm1(0.1)
    assert drv.eps == pytest.approx(expected) and drv.delta == pytest.approx(100 * 1e-8 + 1e-6)
    bs = advanced_composition_bun_steinke(0.1, 1e-8, 100, 1e-6)
    arg = math.sqrt(100 * math.pi / 2) * 0.1 / 1e-6
    assert bs.eps == pytest.approx(100 * 0.01 / 2 + 10 * 0.1 * math.sqrt(2 * math.log(arg)))
    assert best_composition(0.1, 1e-8, 100, 1e-6).eps == min(drv.eps, bs.eps, 10.0)
    tiny = advanced_composition_bun_steinke(1e-9, 0.0, 2, 0.5)
    assert tiny.rule == "basic" and "basic" in tiny.note


def test_subsampling_lemma_4() -> None:
    out = subsample(1.0, 1e-6, 0.01)
    assert out.eps == pytest.approx(math.log1p(0.01 * math.expm1(1.0)))
    assert out.delta == pytest.approx(1e-8)
    with pytest.raises(ValueError, match="q must be < 1/2"):
        subsample(1.0, 1e-6, 0.5)


def test_randomized_deletion_composes_and_bounds() -> None:
    content = certify(BinaryRR(), 8.0, 10**6, 1e-9).other_notion
    composed = compose_with_deletion(content, 0.1, 1e-9)
    assert composed.eps == pytest.approx(content.eps + 0.1)
    assert composed.delta == pytest.approx(2e-9)
    assert composed.neighbouring == "add-remove"
    with pytest.raises(ValueError, match="replacement statement"):
        compose_with_deletion(certify(BinaryRR(), 8.0, 10**6, 1e-9).certified, 0.1, 1e-9)
    assert deletion_offset(0.5, 1e-6) == pytest.approx(4 * math.log(2e6))
    assert deletion_utility_bound(0.5, 1e-6, 10) == pytest.approx(8 * math.log(2e7))


def test_neighbouring_conversions() -> None:
    removal = certify(BinaryRR(), 8.0, 10**6, 1e-9).certified
    group = removal_to_replacement(removal, independent_parts=False)
    assert group.delta == pytest.approx((1 + math.exp(removal.eps)) * removal.delta)
    assert group.neighbouring == "replacement"
    back = replacement_to_removal(group)
    assert back.neighbouring == "removal" and back.eps == group.eps
    with pytest.raises(ValueError, match="removal statement"):
        removal_to_replacement(group, independent_parts=True)


def _binary_rr(eps: float) -> np.ndarray:
    keep = math.exp(eps) / (1 + math.exp(eps))
    return np.array([[keep, 1 - keep], [1 - keep, keep]])


@pytest.mark.parametrize(
    ("eps_b", "eps_f", "t"), [(4.0, 1.0, 1), (4.0, 1.0, 3), (2.0, 3.0, 2), (8.0, 0.5, 8)]
)
def test_theorem_iv1_is_exact_for_binary_rr(eps_b: float, eps_f: float, t: int) -> None:
    """Brute force: the max log-ratio of t fragments of RR(RR_b(x)) equals ε(t)."""
    backstop = _binary_rr(eps_b)
    fragment = _binary_rr(eps_f)
    worst = 0.0
    for outputs in itertools.product([0, 1], repeat=t):
        likelihood = np.prod([fragment[:, y] for y in outputs], axis=0)
        p0, p1 = backstop[0] @ likelihood, backstop[1] @ likelihood
        worst = max(worst, abs(math.log(p0 / p1)))
    assert fragment_eps(eps_b, eps_f, t) == pytest.approx(worst, rel=1e-12)
    assert fragment_eps(eps_b, eps_f, t) <= min(eps_b, t * eps_f) + 1e-12


def test_local_labels_and_limits() -> None:
    assert "ε_ℓ∞" in esa_thm_iv1(6.0, 2.0, 4).note
    assert "ε_ℓ1" in esa_thm_iv1(6.0, 2.0, 4, t=1).note
    with pytest.raises(ValueError, match="t must be <= tau"):
        esa_thm_iv1(6.0, 2.0, 4, t=5)
    assert composed_randomizer_eps(700.0, 700.0) == pytest.approx(700.0 - math.log(2), rel=1e-12)
