"""Local (per-device) privacy of report fragments: ESA-revisited Theorem IV.1.

A backstop ``x' = R_b(x; ε_b)`` drawn once and ``τ`` fresh fragments ``y_r = R_f(x'; ε_f)``:
an adversary who sees ``t`` of the fragments sees an ε(t)-DP local randomizer with

    ε(t) = ln((e^{ε_b + t ε_f} + 1) / (e^{ε_b} + e^{t ε_f})) <= min(ε_b, t ε_f)

(Theorem IV.1, via Corollary .2 of Appendix B; the same ε holds for removal when ``R_b`` is
removal ε_b-DP). ``ε_ℓ∞ = ε(τ)`` (all fragments seen), ``ε_ℓ1 = ε(1)`` (one fragment).
"""

from __future__ import annotations

import math

from common.accounting._checks import check_count, check_positive
from common.accounting.results import BoundResult, Method, Neighbouring

#: The bound ids this module's bounds carry (:meth:`common.accounting.results.Method.declare`).
ESA_THM_IV1 = Method.declare(
    "esa-thm-iv1", "ESA-revisited Theorem IV.1: local ε of report fragments (ε_ℓ∞, ε_ℓ1)", "local"
)


def composed_randomizer_eps(eps1: float, eps2: float) -> float:
    """ESA-revisited Appendix B, Corollary .2: ε of ``R2 ∘ R1`` for ε1-, ε2-DP randomizers.

    ``ln((e^{ε1+ε2} + 1)/(e^{ε1} + e^{ε2}))``, computed in log space.
    """
    eps1 = check_positive("eps1", eps1)
    eps2 = check_positive("eps2", eps2)
    big, small = max(eps1, eps2), min(eps1, eps2)
    # ln(e^{a+b} + 1) - ln(e^a + e^b) with a >= b, rewritten to avoid overflow.
    numerator = (big + small) + math.log1p(math.exp(-(big + small)))
    denominator = big + math.log1p(math.exp(small - big))
    return numerator - denominator


def fragment_eps(eps_b: float, eps_f: float, t: int) -> float:
    """ε(t) of Theorem IV.1 for an adversary holding ``t >= 1`` fragments."""
    t = check_count("t", t)
    return composed_randomizer_eps(eps_b, t * check_positive("eps_f", eps_f))


def esa_thm_iv1(
    eps_b: float,
    eps_f: float,
    tau: int,
    t: int | None = None,
    neighbouring: Neighbouring = "removal",
) -> BoundResult:
    """Theorem IV.1 as a result: local ε when ``t`` (default all ``τ``) fragments are seen.

    Raises:
        ValueError: if ``t`` is not in [1, τ] or a parameter is not positive.
    """
    tau = check_count("tau", tau)
    seen = tau if t is None else check_count("t", t)
    if seen > tau:
        raise ValueError(f"t must be <= tau={tau}, got t={seen}")
    eps = fragment_eps(eps_b, eps_f, seen)
    label = "ε_ℓ∞" if seen == tau else ("ε_ℓ1" if seen == 1 else f"ε(t={seen})")
    return BoundResult(
        eps=eps,
        delta=0.0,
        method=ESA_THM_IV1,
        neighbouring=neighbouring,
        inputs=(("eps_b", eps_b), ("eps_f", eps_f), ("tau", tau), ("t", seen)),
        valid_regime=True,
        note=f"local {label}",
    )
