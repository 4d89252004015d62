"""Typed privacy descriptions of local randomizers, and the certificate they get when shuffled.

A mechanism hands accounting a :class:`LocalRandomizer` (as dp_accounting's ``DpEvent``
describes a mechanism to accountants): a frozen value naming the privacy argument that covers
its reports, with the upper bounds that apply (:class:`MethodSpec`, with the dominating pair
where one exists), its natural neighbouring notion, its local ε and a known lower bound.
:func:`certify`, the planner and lifetime composition consume any description; a new mechanism
reuses one below or subclasses :class:`LocalRandomizer`. The arguments (theorems in
:mod:`.shuffle_bounds`): docs/accounting.md, "The arguments".
"""

from __future__ import annotations

import math
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar

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
from common.accounting.results import BoundResult, InputValue, Method, Neighbouring

#: The bound ids this module's bounds carry (:meth:`common.accounting.results.Method.declare`).
ESA_THM_IV2 = Method.declare("esa-thm-iv2", "ESA-revisited Theorem IV.2, its proven term")
RFRAG_PER_BATCH = Method.declare(
    "rfrag-per-batch", "report fragments when batches hold different users"
)
LOCAL = Method.declare(
    "local", "the trivial bound: the local ε, which shuffling cannot make worse", "local"
)


#: The metadata key of a description's field that a tool may fill from a flag of the same name
#: (``esa account --k``): its help text (:func:`flag`).
FLAG = "flag"


def flag(help_text: str, **kwargs: Any) -> Any:
    """A field of a description that tools offer as a flag of its name (``--eps-f`` for
    ``eps_f``) with ``help_text``: ``esa account`` builds its options from these."""
    return field(metadata={FLAG: help_text}, **kwargs)


def flagged(kinds: Mapping[str, type[LocalRandomizer]]) -> dict[str, tuple[type, list[str]]]:
    """The flags the descriptions ``kinds`` (by the name a user knows them by) take, by field
    name: its value type (the field's, ``None`` aside) and each one's ``"<name>: <help>"``."""
    found: dict[str, tuple[type, list[str]]] = {}
    for label, kind in kinds.items():
        try:
            hints = typing.get_type_hints(kind)
        except (NameError, TypeError):  # a plug-in's annotations that do not resolve: text
            hints = {}
        for spec in fields(kind):  # type: ignore[arg-type]
            if FLAG in spec.metadata:
                hint = hints.get(spec.name, str)
                kept = [t for t in typing.get_args(hint) if t is not type(None)]
                value_type = kept[0] if kept else hint
                found.setdefault(spec.name, (value_type, []))[1].append(
                    f"{label}: {spec.metadata[FLAG]}"
                )
    return found


#: An upper bound as a function of (ε0, n, δ), in the description's natural notion.
BoundFunction = Callable[[float, int, float], BoundResult]
#: A dominating pair as a function of (ε0, n): what numerical methods and PLDs consume.
PairFunction = Callable[[float, int], ClonePair]


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One upper bound that applies to a randomizer.

    ``bound`` computes it; ``pair`` (numerical methods only) gives the reduced clone pair as a
    function of ε0, which lets the planner invert the bound directly and the lifetime
    accountant compose epochs as privacy-loss distributions.
    """

    method: Method
    bound: BoundFunction
    pair: PairFunction | None = None


class LocalRandomizer(ABC):
    """What accounting needs to know of a mechanism's reports, as a function of its ε0.

    Subclasses are frozen dataclasses whose fields are the argument's parameters (validated
    on construction); ``kind`` names the argument in results. ε0 stays an argument of every
    method because the planner searches over it.
    """

    kind: ClassVar[str]
    natural: ClassVar[Neighbouring]

    @abstractmethod
    def methods(self) -> tuple[MethodSpec, ...]:
        """Every upper bound that applies, in the natural notion."""

    def local_eps(self, eps0: float) -> float:
        """The local ε of one report (every certificate is capped at it)."""
        return eps0

    def local_statements(self, eps0: float) -> tuple[BoundResult, ...]:
        """Local-privacy statements shown beside a certificate."""
        return (_local_statement(eps0, self.local_eps(eps0), self.natural),)

    def lower(self, eps0: float, n: int, delta: float) -> BoundResult | None:
        """A lower bound where one is known (shown for honesty, never certified)."""
        return None

    def local_delta(self) -> float:
        """δ of the report's local guarantee (0: pure ε-DP), the trivial bound's δ."""
        return 0.0

    def applicable(self, methods: Collection[Method | str] | None) -> set[Method]:
        """The requested methods (all when None) that apply.

        Raises:
            ValueError: a method that is unknown or does not apply, naming it.
        """
        return _wanted_methods(self, methods)

    def other_notion(
        self,
        eps0: float,
        n: int,
        delta: float,
        methods: Collection[Method | str] | None,
        certified: BoundResult,
    ) -> BoundResult:
        """The certificate in the other neighbouring notion (default: the reference report is
        a mixture of the randomizer's outputs, so removal pairs are mixtures of replacement
        pairs and the same numbers hold)."""
        return replace(certified, neighbouring="removal").with_note(
            "removal with a reference that is a mixture of the randomizer's outputs"
        )

    def inputs(self) -> tuple[tuple[str, InputValue], ...]:
        """The description's parameters as ``(name, value)`` pairs (None omitted)."""
        if not is_dataclass(self):
            return ()
        pairs = ((f.name, getattr(self, f.name)) for f in fields(self))
        return tuple((name, value) for name, value in pairs if value is not None)


class RemovalRandomizer(LocalRandomizer):
    """A randomizer certified under removal whose replacement statement is two removal steps
    on independent parts of the output: any removal bound at δ/2 gives (2ε, δ)."""

    natural: ClassVar[Neighbouring] = "removal"

    def other_notion(
        self,
        eps0: float,
        n: int,
        delta: float,
        methods: Collection[Method | str] | None,
        certified: BoundResult,
    ) -> BoundResult:
        # Recomputing only the method that certified at δ keeps `certify` to one extra bound.
        same = None if certified.method == LOCAL else [certified.method]
        half = best_bound(compute_bounds(self, eps0, n, delta / 2.0, same or methods))
        return removal_to_replacement(half, independent_parts=True)


@dataclass(frozen=True)
class GenericRandomizer(LocalRandomizer):
    """Any ε0-DP local randomizer (replacement), or (ε0, δ0)-DP with ``delta0`` > 0, which
    admits FMT21 Theorem 3.8 only."""

    kind: ClassVar[str] = "generic"
    natural: ClassVar[Neighbouring] = "replacement"
    delta0: float = flag(
        "δ0 of an (ε0, δ0)-DP randomizer (FMT21 Theorem 3.8; default 0)", default=0.0
    )

    def __post_init__(self) -> None:
        check_non_negative("delta0", self.delta0)

    def local_delta(self) -> float:
        return self.delta0

    def methods(self) -> tuple[MethodSpec, ...]:
        return _generic_methods("replacement", self.delta0)

    def applicable(self, methods: Collection[Method | str] | None) -> set[Method]:
        wanted = _wanted_methods(self, methods)
        if self.delta0 > 0.0:
            return wanted & {sb.FMT21_THM38}
        wanted.discard(sb.FMT21_THM38)
        return wanted

    def lower(self, eps0: float, n: int, delta: float) -> BoundResult | None:
        return lower_2rr(eps0, n, delta, self.natural)


@dataclass(frozen=True)
class BinaryRR(RemovalRandomizer):
    """Independent binary randomized responses per attribute at ε0 (k-RAPPOR, ESA-revisited
    Algorithm 1): removing a user flips one attribute's input, and the shuffled multiset is
    the per-attribute counts, so n shuffled binary RR reports bound it; the 2RR lower bound
    applies. Replacement touches two independent attributes (docs/accounting.md)."""

    kind: ClassVar[str] = "binary-rr"

    def methods(self) -> tuple[MethodSpec, ...]:
        return _binary_rr_methods(lambda e: e, "removal")

    def lower(self, eps0: float, n: int, delta: float) -> BoundResult | None:
        return lower_2rr(eps0, n, delta, self.natural)


@dataclass(frozen=True)
class BinaryRRSequence(RemovalRandomizer):
    """Erlingsson et al. 2019, Algorithm 1 at sequence ε: each report is binary RR at ε/2 or
    uniform (a mixture of RR(+1) and RR(-1)), so a batch is bounded as binary RR at ε/2;
    removing a user changes one report, replacing its data two in two periods."""

    kind: ClassVar[str] = "binary-rr-sequence"

    def methods(self) -> tuple[MethodSpec, ...]:
        return _binary_rr_methods(lambda e: e / 2.0, "removal")

    def local_eps(self, eps0: float) -> float:
        return eps0 / 2.0


@dataclass(frozen=True)
class KaryRR(LocalRandomizer):
    """k-ary randomized response (FMT21 §4.1), replacement; removal with the uniform
    reference is a mixture of replacement pairs. The 2RR lower bound applies when k = 2."""

    kind: ClassVar[str] = "k-rr"
    natural: ClassVar[Neighbouring] = "replacement"
    k: int = flag("alphabet size")

    def __post_init__(self) -> None:
        check_count("k", self.k, minimum=2)

    def methods(self) -> tuple[MethodSpec, ...]:
        k = self.k

        def pair(e: float, n: int) -> ClonePair:
            return ClonePair(n - 1, 2.0 / (math.exp(e) + k - 1.0), e, weight=sb.krr_weight(e, k))

        generic = _generic_methods("replacement", 0.0)
        return (
            MethodSpec(sb.FMT21_KRR_COR42, lambda e, n, d: sb.fmt21_krr_cor42(e, n, d, k)),
            MethodSpec(sb.BLANKET_KRR, lambda e, n, d: sb.blanket_krr(e, n, d, k), pair),
            *(m for m in generic if m.method != sb.FMT21_THM38),
        )

    def lower(self, eps0: float, n: int, delta: float) -> BoundResult | None:
        return lower_2rr(eps0, n, delta, self.natural) if self.k == 2 else None


@dataclass(frozen=True)
class BackstopFragments(RemovalRandomizer):
    """Report fragments (ESA-revisited Algorithm 2) at backstop ε0 = ε_b: ``tau`` fragments
    per report, each binary RR at ``eps_f`` of the backstop bit, one (row, bit) per message.
    When every batch holds the same users the binary-RR bounds at ε_b apply, and the generic
    bound at ε_ℓ∞ = ε(τ) of Theorem IV.1; all values are capped at ε_ℓ∞. Of Theorem IV.2
    only its second term is certified (docs/accounting.md says why the first is not a bound).
    Different users per batch: :func:`rfrag_across_batches`."""

    kind: ClassVar[str] = "backstop-fragments"
    eps_f: float = flag("fragment ε_f")
    tau: int = flag("fragments per report")

    def __post_init__(self) -> None:
        check_positive("eps_f", self.eps_f)
        check_count("tau", self.tau)

    def local_eps(self, eps0: float) -> float:
        return fragment_eps(eps0, self.eps_f, self.tau)

    def local_statements(self, eps0: float) -> tuple[BoundResult, ...]:
        return (
            esa_thm_iv1(eps0, self.eps_f, self.tau),
            esa_thm_iv1(eps0, self.eps_f, self.tau, t=1),
        )

    def methods(self) -> tuple[MethodSpec, ...]:
        backstop = _binary_rr_methods(lambda e: e, "removal")
        keep = {sb.CHEU_LEMMA_II6, sb.BLANKET_BINARY_RR}
        iv2 = MethodSpec(
            ESA_THM_IV2,
            lambda e, n, d: replace(
                sb.esa_thm_iii1(e, n, d, "removal"), method=ESA_THM_IV2
            ).with_note("second term of Theorem IV.2 (Theorem III.1 at ε_b); first term not used"),
        )
        inf = self.local_eps
        generic = MethodSpec(
            sb.FMT21_CLONES,
            lambda e, n, d: sb.fmt21_clones(inf(e), n, d, "removal").with_note(
                "generic bound on the τ-tuple at ε_ℓ∞"
            ),
            lambda e, n: ClonePair(n - 1, math.exp(-inf(e)), inf(e)),
        )
        return (*(m for m in backstop if m.method in keep), iv2, generic)


@dataclass(frozen=True)
class BalcerCheuNoise(LocalRandomizer):
    """Balcer–Cheu Theorem 12 (replacement): ε0 is the protocol's per-bin ε and δ the
    histogram's total δ (δ/2 per bin). The noise is sized for a crowd ``n_declared`` and a δ
    ``delta`` (defaults: the crowd and δ certified); with ``delta`` set, every certificate is
    at that δ whatever δ is asked, since the theorem holds for it alone. No dominating pair;
    no local guarantee. Removal changes one bin: (ε', δ/2)."""

    kind: ClassVar[str] = "balcer-cheu"
    natural: ClassVar[Neighbouring] = "replacement"
    n_declared: int | None = flag(
        "the declared crowd size that fixed the noise (default: --n)", default=None
    )
    delta: float | None = None

    def __post_init__(self) -> None:
        if self.n_declared is not None:
            check_count("n_declared", self.n_declared)
        if self.delta is not None:
            check_probability("delta", self.delta)

    def local_eps(self, eps0: float) -> float:
        return math.inf

    def methods(self) -> tuple[MethodSpec, ...]:
        declared, sized = self.n_declared, self.delta

        def bound(e: float, n: int, d: float) -> BoundResult:
            total = d if sized is None else sized
            return sb.balcer_cheu_thm12(e, total / 2.0, n if declared is None else declared, n)

        return (MethodSpec(sb.BALCER_CHEU_THM12, bound),)

    def other_notion(
        self,
        eps0: float,
        n: int,
        delta: float,
        methods: Collection[Method | str] | None,
        certified: BoundResult,
    ) -> BoundResult:
        return replace(
            certified, eps=certified.eps / 2.0, delta=certified.delta / 2.0, neighbouring="removal"
        ).with_note("removal changes one bin: (ε', δ/2)")


def _binary_rr_methods(
    eps_of: Callable[[float], float], natural: Neighbouring
) -> tuple[MethodSpec, ...]:
    """Bounds for a post-processing of binary RR at ``eps_of(ε0)``."""

    def blanket_pair(e: float, n: int) -> ClonePair:
        rr = eps_of(e)
        return ClonePair(n - 1, 2.0 / (math.exp(rr) + 1.0), rr)

    def clones_pair(e: float, n: int) -> ClonePair:
        rr = eps_of(e)
        return ClonePair(n - 1, math.exp(-rr), rr)

    def at(bound: Callable[[float, int, float, Neighbouring], BoundResult]) -> BoundFunction:
        return lambda e, n, d: bound(eps_of(e), n, d, natural)

    return (
        MethodSpec(sb.CHEU_LEMMA_II6, at(sb.cheu_lemma_ii6)),
        MethodSpec(sb.ESA_THM_III1, at(sb.esa_thm_iii1)),
        MethodSpec(sb.BLANKET_BINARY_RR, at(sb.blanket_binary_rr), blanket_pair),
        MethodSpec(sb.FMT21_CLONES, at(sb.fmt21_clones), clones_pair),
        MethodSpec(sb.FMT21_CLOSED, at(sb.fmt21_closed)),
        MethodSpec(sb.EFMRTT19_THM7, at(sb.efmrtt19_thm7)),
    )


def _generic_methods(natural: Neighbouring, delta0: float) -> tuple[MethodSpec, ...]:
    return (
        MethodSpec(sb.EFMRTT19_THM7, lambda e, n, d: sb.efmrtt19_thm7(e, n, d, natural)),
        MethodSpec(sb.FMT21_CLOSED, lambda e, n, d: sb.fmt21_closed(e, n, d, natural)),
        MethodSpec(
            sb.FMT21_CLONES,
            lambda e, n, d: sb.fmt21_clones(e, n, d, natural),
            lambda e, n: ClonePair(n - 1, math.exp(-e), e),
        ),
        MethodSpec(sb.FMT21_THM38, lambda e, n, d: sb.fmt21_thm38(e, delta0, n, d, natural)),
    )


def _local_statement(eps0: float, local: float, notion: Neighbouring) -> BoundResult:
    return BoundResult(
        eps=local,
        delta=0.0,
        method=LOCAL,
        neighbouring=notion,
        inputs=(("eps0", eps0),),
        valid_regime=True,
        note="local ε",
    )


@dataclass(frozen=True, slots=True)
class Certification:
    """Every applicable bound for one (randomizer, ε0, n, δ) and the one certified.

    Attributes:
        certified: The smallest certifiable upper bound in the natural notion.
        bounds: All upper bounds computed (natural notion), the trivial local bound last.
        other_notion: The certificate in the other neighbouring notion.
        lower: A lower bound where one applies (never certified).
        local: Local-privacy statements (ε0, or Theorem IV.1's ε_ℓ∞ / ε_ℓ1).
    """

    randomizer: LocalRandomizer
    eps0: float
    n: int
    delta: float
    certified: BoundResult
    bounds: tuple[BoundResult, ...]
    other_notion: BoundResult
    lower: BoundResult | None
    local: tuple[BoundResult, ...]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (``esa account certify --json``)."""
        return {
            "randomizer": self.randomizer.kind,
            "randomizer_params": dict(self.randomizer.inputs()),
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


def methods_for(randomizer: LocalRandomizer) -> tuple[Method, ...]:
    """The upper-bound method ids that apply to ``randomizer``."""
    return tuple(m.method for m in randomizer.methods() if m.method in randomizer.applicable(None))


def _wanted_methods(
    randomizer: LocalRandomizer, methods: Collection[Method | str] | None
) -> set[Method]:
    available = {m.method for m in randomizer.methods()}
    if methods is None:
        return set(available)
    wanted: set[Method] = set()
    for name in methods:
        method = Method.parse(name)
        if method not in available:
            known = ", ".join(sorted(available))
            raise ValueError(
                f"method {method} does not apply to {randomizer.kind}; applicable: {known}"
            )
        wanted.add(method)
    return wanted


def check_randomizer(randomizer: object) -> LocalRandomizer:
    """``randomizer`` if it is a :class:`LocalRandomizer`.

    Raises:
        TypeError: naming what was passed instead (e.g. an old-style mechanism name).
    """
    if not isinstance(randomizer, LocalRandomizer):
        raise TypeError(
            f"randomizer must be a LocalRandomizer (e.g. BinaryRR(), KaryRR(k=4)), "
            f"got randomizer={randomizer!r}"
        )
    return randomizer


def _validate(eps0: float, n: int, delta: float) -> None:
    check_positive("eps0", eps0)
    check_count("n", n)
    check_probability("delta", delta)


def _clamp(result: BoundResult, local: float) -> BoundResult:
    if result.eps <= local:
        return result
    return replace(result, eps=local).with_note("clamped to the local ε of the report")


def _trivial(
    randomizer: LocalRandomizer, eps0: float, n: int, delta: float, local: float
) -> BoundResult:
    delta0 = randomizer.local_delta()
    return BoundResult(
        eps=local,
        delta=delta0,
        method=LOCAL,
        neighbouring=randomizer.natural,
        inputs=(("eps0", eps0), ("n", n), ("delta", delta)),
        valid_regime=math.isfinite(local),
        note="trivial: the shuffled output is a post-processing of the local reports",
    )


def compute_bounds(
    randomizer: LocalRandomizer,
    eps0: float,
    n: int,
    delta: float,
    methods: Collection[Method | str] | None = None,
) -> tuple[BoundResult, ...]:
    """Upper bounds (natural notion), restricted to ``methods`` if given, trivial bound last.

    Raises:
        ValueError: on bad arguments or a method that does not apply to the randomizer.
    """
    randomizer = check_randomizer(randomizer)
    _validate(eps0, n, delta)
    wanted = randomizer.applicable(methods)
    local = randomizer.local_eps(eps0)
    results = [
        _clamp(m.bound(eps0, n, delta), local) for m in randomizer.methods() if m.method in wanted
    ]
    results.append(_trivial(randomizer, eps0, n, delta, local))
    return tuple(results)


def best_bound(bounds: tuple[BoundResult, ...]) -> BoundResult:
    """The smallest certifiable upper bound (the trivial one is always in ``bounds``)."""
    usable = [b for b in bounds if b.certifiable]
    return min(usable, key=lambda b: b.eps) if usable else bounds[-1]


def certify(
    randomizer: LocalRandomizer,
    eps0: float,
    n: int,
    delta: float,
    methods: Collection[Method | str] | None = None,
) -> Certification:
    """Every applicable bound and the certificate the analyzer would print.

    Args:
        randomizer: The privacy description of the reports (e.g. ``KaryRR(k=4)``).
        eps0: The local ε it is parametrized by (per bit for binary RR, ε_b for backstop
            fragments, the sequence ε for longitudinal reports, the per-bin ε of zsum).
        n: Crowd size (number of contributions in the smallest batch).
        delta: Target δ in (0, 1).
        methods: Restrict to these method ids (``--bound``).

    Raises:
        ValueError: on bad arguments, naming the value; TypeError for a non-randomizer.
    """
    bounds = compute_bounds(randomizer, eps0, n, delta, methods)
    certified = best_bound(bounds)
    return Certification(
        randomizer=randomizer,
        eps0=eps0,
        n=n,
        delta=delta,
        certified=certified,
        bounds=bounds,
        other_notion=randomizer.other_notion(eps0, n, delta, methods, certified),
        lower=randomizer.lower(eps0, n, delta),
        local=randomizer.local_statements(eps0),
    )


def rfrag_across_batches(
    eps_b: float,
    eps_f: float,
    crowds: Sequence[int],
    rows_per_batch: Sequence[int],
    delta: float,
) -> BoundResult:
    """Removal certificate for report fragments when batches hold different sets of users.

    Randomized deletion runs independently at each shuffler, so batch s holds its own crowd
    ``n_s``. Per bit, given the backstops each batch is binary RR at ε_f (``t_s = 1``) or generic
    clones at ``t_s ε_f``; batches compose by basic composition to (ε_M, δ_M), and advanced joint
    convexity (FMT21 Lemma 2.3) through the backstop gives
    ``ε = log(1 + tanh(ε_b/2)(e^{ε_M} - 1))``, capped at ε_ℓ∞ = ε(τ) of Theorem IV.1. Argument:
    docs/accounting.md, "Report fragments across batches".

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
        method=RFRAG_PER_BATCH,
        neighbouring="removal",
        inputs=inputs,
        valid_regime=True,
        note=note,
    )
    return _clamp(result, local)


def _composed_batches(
    eps_f: float, crowds: Sequence[int], rows_per_batch: Sequence[int], share: float
) -> float:
    """Steps 1-2 of the :func:`rfrag_across_batches` argument: Σ_s ε_s, each at δ ``share``."""
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
