"""Amplification-by-shuffling bounds: n reports, each from an ε0-DP local randomizer.

Every function validates its arguments, returns a :class:`BoundResult`, and outside the
theorem's stated regime returns the trivial bound (the local ε0 — the shuffled output is a
post-processing of ε0-DP reports) with ``valid_regime=False`` and a note. Inside the regime a
value above ε0 is clamped to ε0 (still valid, with a note). All ``log`` are natural logs, as in
the papers' proofs.

The neighbouring notion of each result is the one the caller passes: these theorems compare
two datasets that differ in one user's *input to the randomizer*; :mod:`.mechanisms` explains,
per mechanism, which user-level notion that is.
"""

from __future__ import annotations

import math

from common.accounting._checks import (
    check_count,
    check_non_negative,
    check_positive,
    check_probability,
)
from common.accounting.hockey_stick import ClonePair, eps_for_delta
from common.accounting.results import BoundResult, InputValue, Method, Neighbouring

#: The bound ids this module's bounds carry (:meth:`common.accounting.results.Method.declare`).
EFMRTT19_THM7 = Method.declare("efmrtt19-thm7", "EFMRTT19 Theorem 7 (shuffling n ε0-DP reports)")
FMT21_CLOSED = Method.declare("fmt21-closed", "FMT21 Theorem 3.1, closed form (eq. (1))")
FMT21_THM38 = Method.declare("fmt21-thm38", "FMT21 Theorem 3.8, for (ε0, δ0)-DP randomizers")
FMT21_CLONES = Method.declare(
    "fmt21-clones", "FMT21's numerical clones bound (Appendix E), any ε0-DP randomizer"
)
BLANKET_BINARY_RR = Method.declare(
    "blanket-binary-rr",
    "the same hockey-stick computation with the privacy-blanket pair of binary RR",
)
CHEU_LEMMA_II6 = Method.declare(
    "cheu-lemma-ii6", "Cheu et al. as ESA-revisited Lemma II.6 states it (the paper's tables)"
)
ESA_THM_III1 = Method.declare("esa-thm-iii1", "ESA-revisited Theorem III.1, closed form")
FMT21_KRR_COR42 = Method.declare("fmt21-krr-cor42", "FMT21 Corollary 4.2 (k-RR)")
BLANKET_KRR = Method.declare("blanket-krr", "the numerical bound with the k-RR pair")
BALCER_CHEU_THM12 = Method.declare(
    "balcer-cheu-thm12", "Balcer–Cheu Theorem 12 (zero-sum histogram)"
)


def _inputs(**values: InputValue) -> tuple[tuple[str, InputValue], ...]:
    return tuple(values.items())


def _finish(
    method: Method,
    value: float,
    local_eps: float,
    delta: float,
    neighbouring: Neighbouring,
    inputs: tuple[tuple[str, InputValue], ...],
    regime_failure: str | None,
    note: str = "",
) -> BoundResult:
    """Build the result: trivial bound outside the regime, clamp at the local ε inside."""
    if regime_failure is not None:
        return BoundResult(
            eps=local_eps,
            delta=delta,
            method=method,
            neighbouring=neighbouring,
            inputs=inputs,
            valid_regime=False,
            note=f"outside the stated regime ({regime_failure}); trivial bound ε = local ε",
        )
    if not math.isfinite(value) or value > local_eps:
        note = (note + "; " if note else "") + "bound exceeds the local ε; clamped to it"
        value = local_eps
    return BoundResult(
        eps=value,
        delta=delta,
        method=method,
        neighbouring=neighbouring,
        inputs=inputs,
        valid_regime=True,
        note=note,
    )


def _clone_bound(
    method: Method,
    pair: ClonePair,
    eps0: float,
    delta: float,
    neighbouring: Neighbouring,
    inputs: tuple[tuple[str, InputValue], ...],
) -> BoundResult:
    """The bound a clone pair gives (FMT21 eq. (20) with its ``C ~ Bin(n - 1, γ)``): the ε at
    which the pair's hockey-stick divergence is ``delta``, evaluated exactly
    (:mod:`.hockey_stick`) and clamped at the local ε; valid for every n >= 1, ε0 > 0."""
    return _finish(method, eps_for_delta(pair, delta), eps0, delta, neighbouring, inputs, None)


def _check_common(eps0: float, n: int, delta: float) -> tuple[float, int, float]:
    return check_positive("eps0", eps0), check_count("n", n), check_probability("delta", delta)


def efmrtt19_thm7(
    eps0: float, n: int, delta: float, neighbouring: Neighbouring = "replacement"
) -> BoundResult:
    """Erlingsson et al. 2019 (SODA), Theorem 7 and Corollary 9.

    ``ε <= ε1 sqrt(2 n log(1/δ)) + n ε1 (e^ε1 - 1)`` with ``ε1 = 2 e^{2ε0} (e^ε0 - 1) / n``,
    for any integer ``n > 1``; the special forms
    ``e^{2ε0}(e^ε0 - 1) sqrt(8 log(1/δ)/n) + 6 e^{4ε0} (e^ε0 - 1)^2 / n`` (ε0 <= ln(n/4)/3) and
    ``12 ε0 sqrt(log(1/δ)/n)`` (n >= 1000, ε0 < 1/2, δ < 1/100; also Corollary 9 for reports
    shuffled after identical randomizers) are upper bounds on it in their regimes; we return the
    smallest applicable one.

    Raises:
        ValueError: on n < 1, δ outside (0, 1), ε0 <= 0, NaN or inf.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    inputs = _inputs(eps0=eps0, n=n, delta=delta)
    if n <= 1:
        return _finish(EFMRTT19_THM7, math.inf, eps0, delta, neighbouring, inputs, "n > 1")
    log_inv_delta = math.log(1.0 / delta)
    candidates: list[tuple[float, str]] = []
    log_eps1 = math.log(2.0) + 2.0 * eps0 + math.log(math.expm1(eps0)) - math.log(n)
    if log_eps1 < 700:
        eps1 = math.exp(log_eps1)
        main = eps1 * math.sqrt(2.0 * n * log_inv_delta) + n * eps1 * math.expm1(min(eps1, 700))
        candidates.append((main, "main form"))
    if eps0 <= math.log(n / 4.0) / 3.0:
        growth = math.exp(2.0 * eps0) * math.expm1(eps0)
        special = growth * math.sqrt(8.0 * log_inv_delta / n) + 6.0 * growth**2 / n
        candidates.append((special, "form for ε0 <= ln(n/4)/3"))
    if n >= 1000 and eps0 < 0.5 and delta < 0.01:
        candidates.append(
            (12.0 * eps0 * math.sqrt(log_inv_delta / n), "12 ε0 sqrt(log(1/δ)/n) form")
        )
    if not candidates:
        return _finish(EFMRTT19_THM7, math.inf, eps0, delta, neighbouring, inputs, None)
    value, form = min(candidates)
    return _finish(EFMRTT19_THM7, value, eps0, delta, neighbouring, inputs, None, form)


def fmt21_closed(
    eps0: float, n: int, delta: float, neighbouring: Neighbouring = "replacement"
) -> BoundResult:
    """Feldman, McMillan, Talwar 2021, Theorem 3.1, eq. (1).

    ``ε <= log(1 + (e^ε0 - 1)/(e^ε0 + 1) (8 sqrt(e^ε0 log(4/δ))/sqrt(n) + 8 e^ε0 / n))`` for
    ``ε0 <= log(n / (16 log(2/δ)))``.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    inputs = _inputs(eps0=eps0, n=n, delta=delta)
    limit = math.log(n / (16.0 * math.log(2.0 / delta)))
    if eps0 > limit:
        failure = f"needs ε0 <= log(n/(16 log(2/δ))) = {limit:.4g}"
        return _finish(FMT21_CLOSED, math.inf, eps0, delta, neighbouring, inputs, failure)
    return _finish(
        FMT21_CLOSED, _fmt21_eq1(eps0, n, delta), eps0, delta, neighbouring, inputs, None
    )


def _fmt21_eq1(eps0: float, n: int, delta: float) -> float:
    """The larger of FMT21 eq. (1) and the authors' reference form of its last step.

    Eq. (1) mixes the clone bound ``e^ε' - 1 = 8 sqrt(e^ε0 log(4/δ)/n) + 8 e^ε0/n`` with weight
    ``(e^ε0 - 1)/(e^ε0 + 1)``; the FMT21 reference implementation uses the weight
    ``(1 - e^-ε0)/(1 + e^{-ε0-ε'})``, slightly larger, and is the source of the published value
    0.538 at n = 1e5, ε0 = 4, δ = 1e-6 (eq. (1) alone gives 0.5346). Taking the larger keeps
    the certificate at or above both.
    """
    e0 = math.exp(eps0)
    inner = 8.0 * math.sqrt(e0 * math.log(4.0 / delta)) / math.sqrt(n) + 8.0 * e0 / n
    printed = math.tanh(eps0 / 2.0)
    reference = -math.expm1(-eps0) / (1.0 + math.exp(-eps0) / (1.0 + inner))
    return math.log1p(max(printed, reference) * inner)


def fmt21_thm38(
    eps0: float,
    delta0: float,
    n: int,
    delta: float,
    neighbouring: Neighbouring = "replacement",
) -> BoundResult:
    """FMT21 Theorem 3.8: shuffling n (ε0, δ0)-DP randomizers.

    The output is ``(ε, δ' + (e^ε + 1)(1 + e^{-ε0}/2) n δ0)``-DP with ε from eq. (1) at δ'.
    Given a *total* ``delta``, we search the split δ' that leaves room for the δ0 term (ε is
    decreasing in δ', the δ0 term increasing in ε, so the first feasible δ' from above is
    found by bisection). Valid for ``ε0 <= log(n / (16 log(2/δ')))``.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    delta0 = check_non_negative("delta0", delta0)
    inputs = _inputs(eps0=eps0, delta0=delta0, n=n, delta=delta)

    def total_delta(inner: float) -> float:
        eps = min(_fmt21_eq1(eps0, n, inner), eps0)
        return inner + (math.exp(eps) + 1.0) * (1.0 + math.exp(-eps0) / 2.0) * n * delta0

    lo, hi = 0.0, delta
    if total_delta(delta * 1e-12) > delta:
        failure = "the δ0 term alone exceeds the target δ"
        return _finish(FMT21_THM38, math.inf, eps0, delta, neighbouring, inputs, failure)
    lo = delta * 1e-12
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if total_delta(mid) <= delta:
            lo = mid
        else:
            hi = mid
    inner = lo
    limit = math.log(n / (16.0 * math.log(2.0 / inner)))
    if eps0 > limit:
        failure = f"needs ε0 <= log(n/(16 log(2/δ'))) = {limit:.4g}"
        return _finish(FMT21_THM38, math.inf, eps0, delta, neighbouring, inputs, failure)
    return _finish(
        FMT21_THM38,
        _fmt21_eq1(eps0, n, inner),
        eps0,
        delta,
        neighbouring,
        inputs,
        None,
        f"δ split: δ'={inner:.3g} for eq. (1), the rest for the δ0 term",
    )


def fmt21_clones(
    eps0: float, n: int, delta: float, neighbouring: Neighbouring = "replacement"
) -> BoundResult:
    """FMT21 Appendix E numerical bound for any ε0-DP randomizer (C ~ Bin(n-1, e^-ε0)).

    Evaluated exactly as described in :mod:`.hockey_stick`; valid for every n >= 1, ε0 > 0.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    pair = ClonePair(n - 1, math.exp(-eps0), eps0)
    inputs = _inputs(eps0=eps0, n=n, delta=delta)
    return _clone_bound(FMT21_CLONES, pair, eps0, delta, neighbouring, inputs)


def blanket_binary_rr(
    eps0: float, n: int, delta: float, neighbouring: Neighbouring = "replacement"
) -> BoundResult:
    """Binary randomized response with the privacy blanket (FMT21 Remark 3.5 form).

    Every other user's report is a fresh uniform bit with probability
    ``γ = 2/(e^ε0 + 1)`` whatever their data (Balle et al. 2019), so the pair of FMT21
    eq. (20) holds with ``C ~ Bin(n - 1, γ)``; evaluated exactly (:mod:`.hockey_stick`).
    Applies to any report that is a post-processing of one binary RR of the user's bit with
    flip probability ``1/(1 + e^ε0)``. Valid for every n >= 1, ε0 > 0.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    pair = ClonePair(n - 1, 2.0 / (math.exp(eps0) + 1.0), eps0)
    inputs = _inputs(eps0=eps0, n=n, delta=delta)
    return _clone_bound(BLANKET_BINARY_RR, pair, eps0, delta, neighbouring, inputs)


def cheu_lemma_ii6(
    eps0: float, n: int, delta: float, neighbouring: Neighbouring = "removal"
) -> BoundResult:
    """Cheu et al. (Corollary 17) as stated in ESA-revisited Lemma II.6, eq. (1).

    Binary RR with flip probability ``λ/(2n)``; with ``λ = 2n/(1 + e^ε0)`` (ESA-revisited
    proof of Theorem III.1) the shuffled sum is (ε, δ)-DP for
    ``ε = sqrt(32 log(4/δ) / (λ - sqrt(2λ log(2/δ)))) · (1 - (λ - sqrt(2λ log(2/δ)))/n)``,
    valid for ``λ ∈ [14 log(4/δ), n]``. This is the bound behind the paper's tables.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    inputs = _inputs(eps0=eps0, n=n, delta=delta)
    lam = 2.0 * n / (1.0 + math.exp(eps0))
    floor = 14.0 * math.log(4.0 / delta)
    if not floor <= lam <= n:
        failure = f"needs λ = 2n/(1+e^ε0) = {lam:.4g} in [14 log(4/δ), n] = [{floor:.4g}, {n}]"
        return _finish(CHEU_LEMMA_II6, math.inf, eps0, delta, neighbouring, inputs, failure)
    shrunk = lam - math.sqrt(2.0 * lam * math.log(2.0 / delta))
    value = math.sqrt(32.0 * math.log(4.0 / delta) / shrunk) * (1.0 - shrunk / n)
    return _finish(CHEU_LEMMA_II6, value, eps0, delta, neighbouring, inputs, None, f"λ = {lam:.6g}")


def esa_thm_iii1(
    eps0: float, n: int, delta: float, neighbouring: Neighbouring = "removal"
) -> BoundResult:
    """ESA-revisited Theorem III.1: ``ε_c = sqrt(64 e^ε0 log(4/δ) / n)``.

    Valid for ``ε0 ∈ [1, log n - log(14 log(4/δ))]`` and ``δ >= n^{-log n}``.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    inputs = _inputs(eps0=eps0, n=n, delta=delta)
    upper = math.log(n) - math.log(14.0 * math.log(4.0 / delta))
    if not 1.0 <= eps0 <= upper:
        failure = f"needs ε0 in [1, log n - log(14 log(4/δ))] = [1, {upper:.4g}]"
        return _finish(ESA_THM_III1, math.inf, eps0, delta, neighbouring, inputs, failure)
    if math.log(delta) < -(math.log(n) ** 2):
        failure = "needs δ >= n^(-log n)"
        return _finish(ESA_THM_III1, math.inf, eps0, delta, neighbouring, inputs, failure)
    value = math.sqrt(64.0 * math.exp(eps0) * math.log(4.0 / delta) / n)
    return _finish(ESA_THM_III1, value, eps0, delta, neighbouring, inputs, None)


def fmt21_krr_cor42(
    eps0: float, n: int, delta: float, k: int, neighbouring: Neighbouring = "replacement"
) -> BoundResult:
    """FMT21 Corollary 4.2, eq. (10), for k-ary randomized response.

    ``ε <= log(1 + (e^ε0 - 1)(8 sqrt((k+1) log(4/δ)) / sqrt((e^ε0 + k - 1) k n)
    + 8 (k+1)/(k n)))`` for ``ε0 <= log(n / (16 log(2/δ)))``.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    k = check_count("k", k, minimum=2)
    inputs = _inputs(eps0=eps0, n=n, delta=delta, k=k)
    limit = math.log(n / (16.0 * math.log(2.0 / delta)))
    if eps0 > limit:
        failure = f"needs ε0 <= log(n/(16 log(2/δ))) = {limit:.4g}"
        return _finish(FMT21_KRR_COR42, math.inf, eps0, delta, neighbouring, inputs, failure)
    e0 = math.exp(eps0)
    inner = 8.0 * math.sqrt((k + 1) * math.log(4.0 / delta)) / math.sqrt((e0 + k - 1) * k * n)
    inner += 8.0 * (k + 1) / (k * n)
    value = math.log1p(math.expm1(eps0) * inner)
    return _finish(FMT21_KRR_COR42, value, eps0, delta, neighbouring, inputs, None)


def krr_weight(eps0: float, k: int) -> float:
    """``w = (e^ε0 + 1)/(e^ε0 + k - 1)`` written so that k = 2 gives exactly 1."""
    return 1.0 / (1.0 + (k - 2) / (math.exp(eps0) + 1.0))


def blanket_krr(
    eps0: float, n: int, delta: float, k: int, neighbouring: Neighbouring = "replacement"
) -> BoundResult:
    """Numerical bound for k-RR (numerical counterpart of FMT21 Corollary 4.2).

    k-RR reports uniformly with probability ``γ = k/(e^ε0 + k - 1)``. Only reports landing on
    the two candidate values x0, x1 matter: another user lands there as a uniform clone with
    probability ``2/(e^ε0 + k - 1)``; the target lands there with probability
    ``w = (e^ε0 + 1)/(e^ε0 + k - 1)`` and then says x0 w.p. ``e^ε0/(e^ε0 + 1)``. Its other
    outputs are identically distributed under both datasets, so ``δ(ε) <= w δ_pair(ε)``.
    """
    eps0, n, delta = _check_common(eps0, n, delta)
    k = check_count("k", k, minimum=2)
    e0 = math.exp(eps0)
    pair = ClonePair(n - 1, 2.0 / (e0 + k - 1.0), eps0, weight=krr_weight(eps0, k))
    inputs = _inputs(eps0=eps0, n=n, delta=delta, k=k)
    return _clone_bound(BLANKET_KRR, pair, eps0, delta, neighbouring, inputs)


def balcer_cheu_thm12(
    eps: float, delta: float, n_declared: int, n_actual: int | None = None
) -> BoundResult:
    """Balcer & Cheu 2020, Theorems 11–12: the zero-sum histogram is (2ε, 2δ)-DP.

    Each bin adds ``Bin(m, p)`` noise with ``p = 1 - 50 ln(2/δ)/(ε² n_declared)`` fixed by the
    *declared* crowd size. With ``m = n_actual`` users, Theorem 11 applies with
    ``ε' = ε sqrt(n_declared / m)`` (the same p), valid when ``ε' <= 1`` and ``p >= 1/2``
    (equivalently ``m >= 100 ln(2/δ)/ε'²``). Per bin (ε', δ), per histogram (2ε', 2δ),
    replacement neighbours. The returned ``delta`` is the histogram's 2δ.
    """
    eps = check_positive("eps", eps)
    delta = check_probability("delta", delta)
    n_declared = check_count("n_declared", n_declared)
    m = n_declared if n_actual is None else check_count("n_actual", n_actual)
    inputs = _inputs(eps=eps, delta=delta, n_declared=n_declared, n_actual=m)
    eps_eff = eps * math.sqrt(n_declared / m)
    required = 100.0 * math.log(2.0 / delta) / eps**2

    def result(value: float, valid: bool, note: str) -> BoundResult:
        return BoundResult(
            eps=value,
            delta=2 * delta,
            method=BALCER_CHEU_THM12,
            neighbouring="replacement",
            inputs=inputs,
            valid_regime=valid,
            note=note,
        )

    if eps > 1.0 or n_declared < required:
        failure = f"needs ε <= 1 and n >= 100 ln(2/δ)/ε² = {required:.4g}"
        return result(2 * eps, False, f"outside the stated regime ({failure}); mechanism refused")
    if eps_eff > 1.0:
        failure = f"the actual crowd {m} gives ε' = ε sqrt(n_declared/m) = {eps_eff:.4g} > 1"
        return result(math.inf, False, f"outside the stated regime ({failure}); no amplification")
    note = "per bin (ε', δ) with ε' = ε sqrt(n_declared/n_actual); histogram (2ε', 2δ)"
    return result(2 * eps_eff, True, note)
