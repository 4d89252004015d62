"""Which bounds certify which mechanism, and under which neighbouring notion.

Arguments, per mechanism (the sentences below are the proofs' glue; the theorems are cited in
:mod:`.shuffle_bounds`):

``krappor`` (ESA-revisited Algorithm 1), removal. Removing a user replaces its one-hot vector
by the all-zeros reference, which flips the input of exactly one attribute's binary RR; the
other attributes' outputs are identically distributed and independent. The analyzer sees the
per-attribute counts (the shuffled multiset of 1-bit indices *is* those counts), so the removal
central ε is that of n shuffled binary RR reports at ε0: every binary-RR and generic bound at
ε0 applies, and so does the 2RR lower bound. Replacement touches two independent attributes:
(2ε, 2δ) from removal at δ/2.

``rfrag`` (ESA-revisited Algorithm 2), removal, ``eps0`` is the backstop ε_b. Every message
carries ONE (row r, bit j) pair (PROTOCOL.md: uint16 fragment index + uint32 bit index) and the
shuffler flattens and shuffles all messages, so the analyzer sees only per-(r, j) counts. The
backstop and fragment coins are independent across bits, so removing a user changes the input
of bit j alone and the other bits' counts are independent of it: per attribute, the view is a
post-processing of the shuffled multiset of the users' bit-j tuples ``(y_1j..y_τj)``. Each tuple
is a post-processing of the backstop bit ``x'_j``, binary RR at ε_b, so when every shuffler
batch holds the same set of n users the k-RAPPOR bounds at ε_b apply; each tuple is also an
ε(τ)-DP randomizer of the bit (Theorem IV.1, replacement at the bit level), so generic bounds
at ε_ℓ∞ apply too. (Sending a whole row as one message would link bits of one user and void
this argument; the wire format forbids it.) All values are capped at ε_ℓ∞. When randomized
deletion left different users in different batches, use :func:`rfrag_across_batches`. Of
Theorem IV.2 we certify only the second term of its min (Theorem III.1 at ε_b, proven via the
backstop argument above): the first term, as printed, ``sqrt(8 τ ε_f log²(τ ε_f / δ) / n)``, has
no ``e^{ε_f}`` factor and falls below the exact 2RR lower bound for large ε_f (τ = 1,
ε_f = ε_b = 10, n = 10^6, δ = 10^-8: 0.19, while ``lower-2rr`` at ε_ℓ∞ = 9.31 is 0.65), so it is
not an upper bound and is never used.

``longitudinal`` (Erlingsson et al. 2019, Algorithm 1), ``eps0`` is the sequence ε of
Theorem 5 and ``n`` the crowd of one (period, level) batch. Each report is (ε/2)-DP binary RR of
``c`` or a uniform ±1 when ``c = 0``; whatever the data, a report is uniform with probability
``>= 2/(e^{ε/2} + 1)``, so the binary-RR blanket bound at ε/2 applies to a batch. Removing a user
changes at most one report (the one covering its κ*-th change; uniform is a mixture of RR(+1)
and RR(-1), so replacement-pair bounds cover it); replacing its data changes at most two
reports in two periods: (2ε, 2δ) from one report at δ/2.

``zsum`` (Balcer–Cheu Theorem 12), replacement; ``eps0`` is the protocol's per-bin ε and
``delta`` the histogram's total δ (per bin δ/2). Removal changes one bin: (ε', δ/2).

``krr`` (FMT21 §4.1), replacement; removal with the uniform reference is a mixture of
replacement pairs, so the same numbers hold. The 2RR lower bound applies only when k = 2.

``generic``: any ε0-DP randomizer (replacement), optionally (ε0, δ0)-DP (FMT21 Theorem 3.8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from common.accounting import shuffle_bounds as sb
from common.accounting._checks import (
    check_count,
    check_non_negative,
    check_positive,
    check_probability,
)
from common.accounting.composition import removal_to_replacement
from common.accounting.hockey_stick import ClonePair
from common.accounting.local import esa_thm_iv1, fragment_eps
from common.accounting.lower import lower_2rr
from common.accounting.results import BoundResult, Mechanism, Method, Neighbouring


@dataclass(frozen=True, slots=True)
class MechanismParams:
    """Mechanism-specific parameters beyond (ε0, n, δ).

    Attributes:
        k: Alphabet size for ``krr`` (required there).
        eps_f: Fragment ε for ``rfrag`` (required there).
        tau: Fragments per report for ``rfrag`` (required there).
        d: Longitudinal horizon or zsum domain size (informational).
        delta0: δ0 of an (ε0, δ0)-DP randomizer, ``generic`` only.
        n_declared: Declared crowd size that fixed zsum's noise (defaults to n).
    """

    k: int | None = None
    eps_f: float | None = None
    tau: int | None = None
    d: int | None = None
    delta0: float = 0.0
    n_declared: int | None = None


BoundFunction = Callable[[float, int, float, MechanismParams], BoundResult]
PairFunction = Callable[[float, int, MechanismParams], ClonePair]


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One upper bound applicable to a mechanism.

    ``bound`` computes it in the mechanism's natural notion; ``pair`` (numerical methods only)
    gives the reduced clone pair as a function of ε0, which lets the planner invert the bound
    directly (δ at the target ε is monotone in ε0).
    """

    method: Method
    bound: BoundFunction
    pair: PairFunction | None = None


@dataclass(frozen=True, slots=True)
class MechanismSpec:
    """How a mechanism is certified."""

    natural: Neighbouring
    methods: tuple[MethodSpec, ...]
    local_eps: Callable[[float, MechanismParams], float]
    has_lower: Callable[[MechanismParams], bool] = field(default=lambda p: False)
    lower_eps0: Callable[[float, MechanismParams], float] = field(default=lambda e, p: e)


@dataclass(frozen=True, slots=True)
class Certification:
    """Every applicable bound for one (mechanism, ε0, n, δ) and the one certified.

    Attributes:
        certified: The smallest certifiable upper bound in the mechanism's natural notion.
        bounds: All upper bounds computed (natural notion), the trivial local bound last.
        other_notion: The certificate in the other neighbouring notion.
        lower: The 2RR lower bound where it applies (never certified).
        local: Local-privacy statements (ε0, or Theorem IV.1's ε_ℓ∞ / ε_ℓ1).
    """

    mechanism: Mechanism
    eps0: float
    n: int
    delta: float
    params: MechanismParams
    certified: BoundResult
    bounds: tuple[BoundResult, ...]
    other_notion: BoundResult
    lower: BoundResult | None
    local: tuple[BoundResult, ...]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (``esa account certify --json``)."""
        return {
            "mechanism": str(self.mechanism),
            "eps0": self.eps0,
            "n": self.n,
            "delta": self.delta,
            "certified": {
                "method": str(self.certified.method),
                "eps": self.certified.eps,
                "delta": self.certified.delta,
                "neighbouring": self.certified.neighbouring,
            },
            "other_notion": self.other_notion.as_dict(),
            "bounds": [b.as_dict() for b in self.bounds],
            "lower": None if self.lower is None else self.lower.as_dict(),
            "local": [b.as_dict() for b in self.local],
        }


def _require(name: str, value: object) -> None:
    if value is None:
        raise ValueError(f"{name} is required for this mechanism, got {name}=None")


def _binary_rr_methods(
    eps_of: Callable[[float, MechanismParams], float], natural: Neighbouring
) -> tuple[MethodSpec, ...]:
    """Bounds for a post-processing of binary RR at ``eps_of(ε0)`` (k-RAPPOR-like)."""

    def blanket_pair(e: float, n: int, p: MechanismParams) -> ClonePair:
        rr = eps_of(e, p)
        return ClonePair(n - 1, 2.0 / (math.exp(rr) + 1.0), rr)

    def clones_pair(e: float, n: int, p: MechanismParams) -> ClonePair:
        rr = eps_of(e, p)
        return ClonePair(n - 1, math.exp(-rr), rr)

    return (
        MethodSpec(
            Method.CHEU_LEMMA_II6, lambda e, n, d, p: sb.cheu_lemma_ii6(eps_of(e, p), n, d, natural)
        ),
        MethodSpec(
            Method.ESA_THM_III1, lambda e, n, d, p: sb.esa_thm_iii1(eps_of(e, p), n, d, natural)
        ),
        MethodSpec(
            Method.BLANKET_BINARY_RR,
            lambda e, n, d, p: sb.blanket_binary_rr(eps_of(e, p), n, d, natural),
            blanket_pair,
        ),
        MethodSpec(
            Method.FMT21_CLONES,
            lambda e, n, d, p: sb.fmt21_clones(eps_of(e, p), n, d, natural),
            clones_pair,
        ),
        MethodSpec(
            Method.FMT21_CLOSED, lambda e, n, d, p: sb.fmt21_closed(eps_of(e, p), n, d, natural)
        ),
        MethodSpec(
            Method.EFMRTT19_THM7, lambda e, n, d, p: sb.efmrtt19_thm7(eps_of(e, p), n, d, natural)
        ),
    )


def _generic_methods(natural: Neighbouring) -> tuple[MethodSpec, ...]:
    return (
        MethodSpec(Method.EFMRTT19_THM7, lambda e, n, d, p: sb.efmrtt19_thm7(e, n, d, natural)),
        MethodSpec(Method.FMT21_CLOSED, lambda e, n, d, p: sb.fmt21_closed(e, n, d, natural)),
        MethodSpec(
            Method.FMT21_CLONES,
            lambda e, n, d, p: sb.fmt21_clones(e, n, d, natural),
            lambda e, n, p: ClonePair(n - 1, math.exp(-e), e),
        ),
        MethodSpec(
            Method.FMT21_THM38, lambda e, n, d, p: sb.fmt21_thm38(e, p.delta0, n, d, natural)
        ),
    )


def _rfrag_eps_inf(eps_b: float, p: MechanismParams) -> float:
    _require("eps_f", p.eps_f)
    _require("tau", p.tau)
    return fragment_eps(eps_b, float(p.eps_f or 0.0), int(p.tau or 0))


def _rfrag_methods() -> tuple[MethodSpec, ...]:
    backstop = _binary_rr_methods(lambda e, p: e, "removal")
    keep = {Method.CHEU_LEMMA_II6, Method.BLANKET_BINARY_RR}
    iv2 = MethodSpec(
        Method.ESA_THM_IV2,
        lambda e, n, d, p: replace(
            sb.esa_thm_iii1(e, n, d, "removal"), method=Method.ESA_THM_IV2
        ).with_note("second term of Theorem IV.2 (Theorem III.1 at ε_b); first term not used"),
    )
    generic = MethodSpec(
        Method.FMT21_CLONES,
        lambda e, n, d, p: sb.fmt21_clones(_rfrag_eps_inf(e, p), n, d, "removal").with_note(
            "generic bound on the τ-tuple at ε_ℓ∞"
        ),
        lambda e, n, p: ClonePair(n - 1, math.exp(-_rfrag_eps_inf(e, p)), _rfrag_eps_inf(e, p)),
    )
    return (*(m for m in backstop if m.method in keep), iv2, generic)


def _krr_methods() -> tuple[MethodSpec, ...]:
    def k_of(p: MechanismParams) -> int:
        _require("k", p.k)
        return int(p.k or 0)

    def krr_pair(e: float, n: int, p: MechanismParams) -> ClonePair:
        e0, k = math.exp(e), k_of(p)
        return ClonePair(n - 1, 2.0 / (e0 + k - 1.0), e, weight=sb.krr_weight(e, k))

    return (
        MethodSpec(Method.FMT21_KRR_COR42, lambda e, n, d, p: sb.fmt21_krr_cor42(e, n, d, k_of(p))),
        MethodSpec(
            Method.BLANKET_KRR, lambda e, n, d, p: sb.blanket_krr(e, n, d, k_of(p)), krr_pair
        ),
        *(m for m in _generic_methods("replacement") if m.method != Method.FMT21_THM38),
    )


def _zsum_bound(e: float, n: int, d: float, p: MechanismParams) -> BoundResult:
    declared = n if p.n_declared is None else p.n_declared
    return sb.balcer_cheu_thm12(e, d / 2.0, declared, n)


SPECS: dict[Mechanism, MechanismSpec] = {
    Mechanism.GENERIC: MechanismSpec(
        natural="replacement",
        methods=_generic_methods("replacement"),
        local_eps=lambda e, p: e,
        has_lower=lambda p: True,
    ),
    Mechanism.KRAPPOR: MechanismSpec(
        natural="removal",
        methods=_binary_rr_methods(lambda e, p: e, "removal"),
        local_eps=lambda e, p: e,
        has_lower=lambda p: True,
    ),
    Mechanism.RFRAG: MechanismSpec(
        natural="removal", methods=_rfrag_methods(), local_eps=_rfrag_eps_inf
    ),
    Mechanism.LONGITUDINAL: MechanismSpec(
        natural="removal",
        methods=_binary_rr_methods(lambda e, p: e / 2.0, "removal"),
        local_eps=lambda e, p: e / 2.0,
    ),
    Mechanism.ZSUM: MechanismSpec(
        natural="replacement",
        methods=(MethodSpec(Method.BALCER_CHEU_THM12, _zsum_bound),),
        local_eps=lambda e, p: math.inf,
    ),
    Mechanism.KRR: MechanismSpec(
        natural="replacement",
        methods=_krr_methods(),
        local_eps=lambda e, p: e,
        has_lower=lambda p: p.k == 2,
    ),
}


def rfrag_across_batches(
    eps_b: float,
    eps_f: float,
    crowds: Sequence[int],
    rows_per_batch: Sequence[int],
    delta: float,
) -> BoundResult:
    """Removal certificate for report fragments when batches hold different sets of users.

    Randomized deletion runs independently at each shuffler, so shuffler batch s holds its own
    crowd ``n_s``; the same-users argument of the module docstring then fails. Argument used
    instead (removal, per attribute bit j):

    1. Condition on every user's backstop bits x'. Batch s is then a fresh-noise mechanism of
       the bits x'_j of its n_s users: each user's bit-j messages in batch s are ``t_s``
       independent binary RRs at ε_f of x'_j. For ``t_s = 1`` the binary-RR blanket bound at
       ε_f with crowd n_s applies, otherwise the generic clones bound at ``t_s ε_f`` (both are
       statements about flipping x'_j).
    2. Given x', the K batches use independent coins: basic composition bounds the whole view
       by ``(ε_M, δ_M) = (Σ_s ε_s, Σ_s δ_s)`` with respect to x'_j, each δ_s = δ/K.
    3. ``x'_j = RR_b(x_j; ε_b)``: the outputs for x_j = 1 and x_j = 0 are the mixtures
       ``q A + (1-q) B`` and ``(1-q) A + q B`` of ``A = M(x'_j=1)``, ``B = M(x'_j=0)``,
       ``q = e^{ε_b}/(1+e^{ε_b})``. Advanced joint convexity (FMT21 Lemma 2.3) around the
       midpoint gives ``ε = log(1 + tanh(ε_b/2)(e^{ε_M} - 1))`` at ``δ <= δ_M``.

    The result is capped at ε_ℓ∞ = ε(τ) of Theorem IV.1 (τ = Σ_s t_s).

    Raises:
        ValueError: on empty or mismatched crowds/rows, or bad ε, δ.
    """
    check_positive("eps_b", eps_b)
    check_positive("eps_f", eps_f)
    check_probability("delta", delta)
    if not crowds or len(crowds) != len(rows_per_batch):
        raise ValueError(
            f"crowds and rows_per_batch must be non-empty and of equal length, got "
            f"crowds={list(crowds)!r}, rows_per_batch={list(rows_per_batch)!r}"
        )
    eps_m = _composed_batches(eps_f, crowds, rows_per_batch, delta / len(crowds))
    value = math.log1p(math.tanh(eps_b / 2.0) * math.expm1(min(eps_m, 700.0)))
    local = fragment_eps(eps_b, eps_f, sum(rows_per_batch))
    inputs = (
        ("eps_b", eps_b),
        ("eps_f", eps_f),
        ("crowds", ",".join(map(str, crowds))),
        ("rows_per_batch", ",".join(map(str, rows_per_batch))),
        ("delta", delta),
    )
    note = f"per-batch composition (ε_M = {eps_m:.4g}) mixed by the backstop"
    result = BoundResult(
        eps=value,
        delta=delta,
        method=Method.RFRAG_PER_BATCH,
        neighbouring="removal",
        inputs=inputs,
        valid_regime=True,
        note=note,
    )
    return _clamp(result, local)


def _composed_batches(
    eps_f: float, crowds: Sequence[int], rows_per_batch: Sequence[int], share: float
) -> float:
    """Steps 1-2 of :func:`rfrag_across_batches`: Σ_s ε_s, each batch at δ ``share``."""
    eps_m = 0.0
    for crowd, rows in zip(crowds, rows_per_batch, strict=True):
        check_count("crowd", crowd)
        check_count("rows", rows)
        per_batch = (
            sb.blanket_binary_rr(eps_f, crowd, share)
            if rows == 1
            else sb.fmt21_clones(rows * eps_f, crowd, share)
        )
        eps_m += per_batch.eps
    return eps_m


def methods_for(mechanism: Mechanism | str) -> tuple[Method, ...]:
    """The upper-bound method ids that apply to ``mechanism``."""
    return tuple(m.method for m in SPECS[_mechanism(mechanism)].methods)


def _mechanism(value: Mechanism | str) -> Mechanism:
    try:
        return Mechanism(value)
    except ValueError:
        names = ", ".join(m.value for m in Mechanism)
        raise ValueError(f"mechanism must be one of {names}; got mechanism={value!r}") from None


def _validate(eps0: float, n: int, delta: float, params: MechanismParams) -> None:
    check_positive("eps0", eps0)
    check_count("n", n)
    check_probability("delta", delta)
    check_non_negative("delta0", params.delta0)
    if params.k is not None:
        # k is k-RR's alphabet (its bounds require >= 2) or the longitudinal change bound (>= 1).
        check_count("k", params.k, minimum=1)
    if params.eps_f is not None:
        check_positive("eps_f", params.eps_f)
    if params.tau is not None:
        check_count("tau", params.tau)
    if params.d is not None:
        check_count("d", params.d)
    if params.n_declared is not None:
        check_count("n_declared", params.n_declared)


def _clamp(result: BoundResult, local: float) -> BoundResult:
    if result.eps <= local:
        return result
    return replace(result, eps=local).with_note("clamped to the local ε of the report")


def _trivial(
    eps0: float, n: int, delta: float, local: float, notion: Neighbouring, delta0: float
) -> BoundResult:
    return BoundResult(
        eps=local,
        delta=delta0,
        method=Method.LOCAL,
        neighbouring=notion,
        inputs=(("eps0", eps0), ("n", n), ("delta", delta)),
        valid_regime=math.isfinite(local),
        note="trivial: the shuffled output is a post-processing of the local reports",
    )


def compute_bounds(
    mechanism: Mechanism | str,
    eps0: float,
    n: int,
    delta: float,
    params: MechanismParams,
    methods: Collection[Method | str] | None = None,
) -> tuple[BoundResult, ...]:
    """Upper bounds (natural notion), restricted to ``methods`` if given, trivial bound last.

    Raises:
        ValueError: on bad arguments or a method that does not apply to the mechanism.
    """
    mech = _mechanism(mechanism)
    _validate(eps0, n, delta, params)
    spec = SPECS[mech]
    wanted = applicable_methods(mech, params, methods)
    local = spec.local_eps(eps0, params)
    results = [
        _clamp(m.bound(eps0, n, delta, params), local) for m in spec.methods if m.method in wanted
    ]
    results.append(_trivial(eps0, n, delta, local, spec.natural, params.delta0))
    return tuple(results)


def applicable_methods(
    mech: Mechanism, params: MechanismParams, methods: Collection[Method | str] | None
) -> set[Method]:
    """The requested methods that apply; (ε0, δ0)-DP randomizers only admit Theorem 3.8."""
    wanted = _wanted_methods(mech, methods)
    if mech is Mechanism.GENERIC and params.delta0 == 0.0:
        wanted.discard(Method.FMT21_THM38)
    if mech is Mechanism.GENERIC and params.delta0 > 0.0:
        wanted &= {Method.FMT21_THM38}
    return wanted


def _wanted_methods(mech: Mechanism, methods: Collection[Method | str] | None) -> set[Method]:
    available = {m.method for m in SPECS[mech].methods}
    if methods is None:
        return set(available)
    wanted: set[Method] = set()
    for name in methods:
        try:
            method = Method(name)
        except ValueError:
            raise ValueError(f"unknown method {name!r}; known: {', '.join(Method)}") from None
        if method not in available:
            known = ", ".join(sorted(available))
            raise ValueError(f"method {method} does not apply to {mech}; applicable: {known}")
        wanted.add(method)
    return wanted


def best_bound(bounds: tuple[BoundResult, ...]) -> BoundResult:
    """The smallest certifiable upper bound (the trivial one is always in ``bounds``)."""
    usable = [b for b in bounds if b.certifiable]
    return min(usable, key=lambda b: b.eps) if usable else bounds[-1]


def certify(
    mechanism: Mechanism | str,
    eps0: float,
    n: int,
    delta: float,
    params: MechanismParams | None = None,
    methods: Collection[Method | str] | None = None,
) -> Certification:
    """Every applicable bound and the certificate the analyzer would print.

    Args:
        mechanism: One of :class:`Mechanism`.
        eps0: The mechanism's local ε (per bit for krappor, ε_b for rfrag, the sequence ε for
            longitudinal, the per-bin ε for zsum).
        n: Crowd size (number of contributions in the smallest batch).
        delta: Target δ in (0, 1).
        params: Mechanism-specific parameters.
        methods: Restrict to these method ids (``--bound``).

    Raises:
        ValueError: on bad arguments, naming the value.
    """
    mech = _mechanism(mechanism)
    params = params or MechanismParams()
    bounds = compute_bounds(mech, eps0, n, delta, params, methods)
    certified = best_bound(bounds)
    return Certification(
        mechanism=mech,
        eps0=eps0,
        n=n,
        delta=delta,
        params=params,
        certified=certified,
        bounds=bounds,
        other_notion=_other_notion(mech, eps0, n, delta, params, methods, certified),
        lower=_lower(mech, eps0, n, delta, params),
        local=_local(mech, eps0, params),
    )


def _other_notion(
    mech: Mechanism,
    eps0: float,
    n: int,
    delta: float,
    params: MechanismParams,
    methods: Collection[Method | str] | None,
    certified: BoundResult,
) -> BoundResult:
    if mech in (Mechanism.KRAPPOR, Mechanism.RFRAG, Mechanism.LONGITUDINAL):
        # Any valid removal bound at δ/2 gives a valid replacement certificate; recomputing
        # only the method that certified at δ keeps `certify` to one extra evaluation.
        same = None if certified.method is Method.LOCAL else [certified.method]
        half = best_bound(compute_bounds(mech, eps0, n, delta / 2.0, params, same or methods))
        return removal_to_replacement(half, independent_parts=True)
    if mech is Mechanism.ZSUM:
        return replace(
            certified, eps=certified.eps / 2.0, delta=certified.delta / 2.0, neighbouring="removal"
        ).with_note("removal changes one bin: (ε', δ/2)")
    return replace(certified, neighbouring="removal").with_note(
        "removal with a reference that is a mixture of the randomizer's outputs"
    )


def _lower(
    mech: Mechanism, eps0: float, n: int, delta: float, params: MechanismParams
) -> BoundResult | None:
    spec = SPECS[mech]
    if not spec.has_lower(params):
        return None
    return lower_2rr(spec.lower_eps0(eps0, params), n, delta, spec.natural)


def _local(mech: Mechanism, eps0: float, params: MechanismParams) -> tuple[BoundResult, ...]:
    if mech is Mechanism.RFRAG:
        tau = int(params.tau or 0)
        return (
            esa_thm_iv1(eps0, float(params.eps_f or 0.0), tau),
            esa_thm_iv1(eps0, float(params.eps_f or 0.0), tau, t=1),
        )
    spec = SPECS[mech]
    local = spec.local_eps(eps0, params)
    inputs = (("eps0", eps0),)
    statement = BoundResult(
        eps=local,
        delta=0.0,
        method=Method.LOCAL,
        neighbouring=spec.natural,
        inputs=inputs,
        valid_regime=True,
        note="local ε",
    )
    return (statement,)
