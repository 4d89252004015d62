"""Bad inputs raise ValueError naming the value; out-of-regime inputs are flagged; tails."""

from __future__ import annotations

import math

import pytest

from common.accounting import (
    BackstopFragments,
    BinaryRR,
    GenericRandomizer,
    KaryRR,
    balcer_cheu_thm12,
    certify,
    cheu_lemma_ii6,
    efmrtt19_thm7,
    esa_thm_iii1,
    fmt21_clones,
    fmt21_closed,
    fmt21_krr_cor42,
    lower_2rr,
    plan_eps0,
)

BOUNDS = [efmrtt19_thm7, fmt21_closed, fmt21_clones, cheu_lemma_ii6, esa_thm_iii1, lower_2rr]


@pytest.mark.parametrize("bound", BOUNDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("eps0", "n", "delta", "named"),
    [
        (1.0, 0, 1e-6, "n=0"),
        (1.0, -5, 1e-6, "n=-5"),
        (1.0, 2.5, 1e-6, "n=2.5"),
        (1.0, 100, 0.0, "delta=0.0"),
        (1.0, 100, 1.0, "delta=1.0"),
        (1.0, 100, 1.5, "delta=1.5"),
        (0.0, 100, 1e-6, "eps0=0.0"),
        (-1.0, 100, 1e-6, "eps0=-1.0"),
        (math.nan, 100, 1e-6, "eps0=nan"),
        (math.inf, 100, 1e-6, "eps0=inf"),
        (1.0, 100, math.nan, "delta=nan"),
        (1.0, math.inf, 1e-6, "n=inf"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_value(
    bound: object, eps0: float, n: float, delta: float, named: str
) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        bound(eps0, n, delta)  # type: ignore[operator]


def test_bad_mechanism_arguments() -> None:
    with pytest.raises(TypeError, match=r"randomizer must be a LocalRandomizer.*'sketch'"):
        certify("sketch", 1.0, 100, 1e-6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k=1"):
        KaryRR(k=1)
    with pytest.raises(ValueError, match="k must be an integer >= 2"):
        fmt21_krr_cor42(1.0, 100, 1e-6, k=1)
    with pytest.raises(ValueError, match="eps_f=0"):
        BackstopFragments(eps_f=0, tau=4)
    with pytest.raises(ValueError, match="does not apply to binary-rr"):
        certify(BinaryRR(), 1.0, 100, 1e-6, methods=["blanket-krr"])
    with pytest.raises(ValueError, match="target_eps must be > 0"):
        plan_eps0(0.0, 1e-6, 100)


@pytest.mark.parametrize(
    ("bound", "args", "reason"),
    [
        (fmt21_closed, (10.0, 1000, 1e-6), "log(n/(16 log(2/δ)))"),
        (cheu_lemma_ii6, (12.0, 10_000, 1e-9), "λ = 2n/(1+e^ε0)"),
        (esa_thm_iii1, (0.5, 10**6, 1e-9), "ε0 in [1"),
    ],
)
def test_out_of_regime_gives_trivial_bound_with_note(
    bound: object, args: tuple[float, int, float], reason: str
) -> None:
    result = bound(*args)  # type: ignore[operator]
    assert not result.valid_regime
    assert result.eps == args[0]
    assert reason in result.note


def test_balcer_cheu_refuses_outside_regime() -> None:
    assert not balcer_cheu_thm12(1.5, 1e-6, 10**6).valid_regime
    assert not balcer_cheu_thm12(0.1, 1e-6, 1000).valid_regime
    ok = balcer_cheu_thm12(0.5, 1e-6, 10**5)
    assert ok.valid_regime and ok.eps == pytest.approx(1.0) and ok.delta == pytest.approx(2e-6)
    smaller_crowd = balcer_cheu_thm12(0.5, 1e-6, 10**5, n_actual=80_000)
    assert smaller_crowd.eps == pytest.approx(2 * 0.5 * math.sqrt(10**5 / 80_000))


@pytest.mark.parametrize("n", [1, 2, 1_000, 10**9])
@pytest.mark.parametrize("eps0", [0.01, 1.0, 20.0])
@pytest.mark.parametrize("delta", [1e-15, 1e-3])
def test_extreme_tails_stay_sane(n: int, eps0: float, delta: float) -> None:
    cert = certify(BinaryRR(), eps0, n, delta)
    assert cert.lower is not None
    assert 0.0 <= cert.lower.eps <= cert.certified.eps * (1 + 1e-9) + 1e-12
    assert cert.certified.eps <= eps0
    assert math.isfinite(cert.certified.eps)


def test_large_n_small_eps0_amplifies_strongly() -> None:
    value = certify(GenericRandomizer(), 0.5, 10**9, 1e-15).certified.eps
    assert 0 < value < 1e-3
    assert lower_2rr(0.5, 10**9, 1e-15).eps > 0.5 * value


def test_bound_ids_are_declared_by_their_bounds_and_the_set_is_open() -> None:
    """Every id is declared once, by the module of its bound, with what it cites; a plug-in
    declares its own without editing a list; an unknown or repeated id is refused by name."""
    from common.accounting import shuffle_bounds as sb
    from common.accounting.results import Method

    shuffled = Method.declared("shuffled")
    assert sb.FMT21_CLOSED in shuffled and "local" not in shuffled and "lower-2rr" not in shuffled
    assert Method.declared("lower") == ["lower-2rr"]
    assert sb.FMT21_CLOSED.cites.startswith("FMT21 Theorem 3.1")
    assert Method.parse("blanket-krr") == sb.BLANKET_KRR
    with pytest.raises(ValueError, match="unknown method 'fmt99'"):
        Method.parse("fmt99")
    with pytest.raises(ValueError, match="declared twice"):
        Method.declare("fmt21-closed", "again")
    mine = Method.declare("toy-plugin-bound", "a plug-in's own theorem")
    try:
        assert Method.parse("toy-plugin-bound") == mine and mine in Method.declared("shuffled")
    finally:
        Method._declared.pop("toy-plugin-bound")
