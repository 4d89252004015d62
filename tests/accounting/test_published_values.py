"""Reference values from the papers (docs/accounting.md, "Published values")."""

from __future__ import annotations

import pytest

from common.accounting import (
    BinaryRR,
    GenericRandomizer,
    certify,
    cheu_lemma_ii6,
    fmt21_clones,
    fmt21_closed,
    plan_eps0,
)

TABLE_I_N = 203_950_512
TABLE_I_DELTA = 5e-10
TABLE_IV_N = 1_914_589
TABLE_IV_DELTA = 5e-8


@pytest.mark.parametrize(
    ("eps_c", "published"),
    [(0.0025, 1.78), (0.01, 4.07), (0.05, 7.235), (0.25, 10.40), (1.0, 12.99)],
)
def test_table_i_eps_l_inf_column(eps_c: float, published: float) -> None:
    plan = plan_eps0(eps_c, TABLE_I_DELTA, TABLE_I_N, BinaryRR(), bound="cheu-lemma-ii6")
    assert plan.eps0 == pytest.approx(published, abs=0.005)


@pytest.mark.parametrize(
    ("eps_c", "published"),
    [(0.05, 2.94), (0.25, 5.96), (0.5, 7.28), (0.75, 8.03), (1.0, 8.55)],
)
def test_table_iv_eps_l_inf_column(eps_c: float, published: float) -> None:
    plan = plan_eps0(eps_c, TABLE_IV_DELTA, TABLE_IV_N, BinaryRR(), bound="cheu-lemma-ii6")
    assert plan.eps0 == pytest.approx(published, abs=0.005)


def test_table_i_headline_two_decimals() -> None:
    plan = plan_eps0(1.0, TABLE_I_DELTA, TABLE_I_N, BinaryRR(), bound="cheu-lemma-ii6")
    assert f"{plan.eps0:.2f}" == "12.99"
    assert cheu_lemma_ii6(plan.eps0, TABLE_I_N, TABLE_I_DELTA).eps <= 1.0


def test_tightest_bound_allows_larger_eps0_than_the_paper() -> None:
    paper = plan_eps0(1.0, TABLE_I_DELTA, TABLE_I_N, BinaryRR(), bound="cheu-lemma-ii6")
    tightest = plan_eps0(1.0, TABLE_I_DELTA, TABLE_I_N, BinaryRR())
    assert tightest.eps0 > paper.eps0 + 1.0
    assert tightest.certification.certified.eps <= 1.0


def test_fmt21_closed_form_reference_value() -> None:
    assert round(fmt21_closed(4.0, 100_000, 1e-6).eps, 3) == 0.538


def test_fmt21_numerical_clones_between_published_lower_and_upper() -> None:
    value = fmt21_clones(4.0, 100_000, 1e-6).eps
    assert 0.1675 <= value <= 0.1728


def test_generic_certificate_at_the_fmt21_point_is_the_clones_bound() -> None:
    cert = certify(GenericRandomizer(), 4.0, 100_000, 1e-6)
    assert str(cert.certified.method) == "fmt21-clones"
    assert cert.lower is not None and cert.lower.eps < cert.certified.eps
