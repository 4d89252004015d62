"""Lifetime privacy: tight composition of a user's epochs with privacy-loss distributions.

Each shuffled epoch enters as its dominating pair (the FMT21 clone pair of Remark 3.5,
eq. (20); the blanket pair for binary RR, Balle et al. 2019; the k-RR pair with its weight,
FMT21 §4.1), and the epochs compose through their PLDs (Koskela, Jälkö, Honkela 2020;
dominating pairs compose: Zhu, Dong, Wang 2022, Theorem 10) with dp_accounting's pessimistic
estimates, so the lifetime ε is a certified upper bound. Mechanisms without a pair enter as
their (ε, δ) certificate; basic and advanced composition are reported beside the PLD.

Derivation (loss PMF, blocking, truncation, rounding): docs/accounting.md, "Lifetime
composition (PLD)".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import numpy.typing as npt
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld
from scipy import stats

from common.accounting import hockey_stick
from common.accounting._checks import (
    check_count,
    check_non_negative,
    check_positive,
    check_probability,
)
from common.accounting.composition import EpsDelta, basic_composition, best_composition
from common.accounting.hockey_stick import ClonePair, eps_for_delta
from common.accounting.planner import EPS0_MAX
from common.accounting.randomizers import LocalRandomizer, certify, check_randomizer
from common.accounting.results import Neighbouring

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Clone-count blocks for the PLD are about sqrt(c)/PLD_SQRT_DIVISIONS wide (a fixed fraction
#: of the spread of C near c; each block is charged at its left end, FMT21 Lemma E.2).
PLD_SQRT_DIVISIONS = 16
#: Grid step h = sd(lifetime loss) / (RESOLUTION · parts): rounding every part's loss up by at
#: most h moves the lifetime loss up by at most sd/RESOLUTION (about 0.5% of ε at worst).
RESOLUTION = 50.0
#: Bounds on the grid step h (the upper one keeps single-epoch rounding below 1e-3 in ε).
MIN_DISCRETIZATION = 1e-8
MAX_DISCRETIZATION = 1e-3
#: Largest loss grid of one part; h is coarsened if a part's losses would need more points.
MAX_PMF_POINTS = 1 << 22
#: Fraction of the target δ that all truncations together (C window, x tails, dp_accounting's
#: tail truncation) may cost; charged as infinite loss, so it is part of the certified δ.
TRUNCATION_FRACTION = 1e-6
#: Relative inflation of every probability mass (covers scipy's pmf/cdf error, about 1e-12).
MASS_SLACK = 1e-9
#: Allowance added to every loss before rounding up (covers float error in L and L/h).
LOSS_SLACK = 1e-12
#: Candidate fractions of δ kept as the δ' of advanced composition.
ADVANCED_SLACK_FRACTIONS = (0.1, 0.5, 0.9)
#: lifetime_for_mechanism: share of δ given to per-epoch certificates of pair-less mechanisms.
CERTIFICATE_SHARE = 0.5
#: lifetime_for_mechanism: with more distinct crowds than this, each crowd is rounded DOWN to
#: a multiple of 2^(bits(n) - 1 - CROWD_GRID_BITS) (at most 2^-CROWD_GRID_BITS below n, so the
#: ε of an epoch grows by about half that), which lets epochs share one PLD.
MAX_EXACT_CROWDS = 8
CROWD_GRID_BITS = 7
#: Resolution of the lifetime planner's bisection on ε0.
PLAN_TOLERANCE = 1e-4


@dataclass(frozen=True, slots=True)
class Certificate:
    """An (ε, δ) statement used as a black box in the composition.

    Attributes:
        eps: The ε (>= 0; ``math.inf`` when nothing is certified).
        delta: The δ in [0, 1).
        source: Which theorem produced it (a method id, or ``esa-thm-v1`` for deletion).
    """

    eps: float
    delta: float
    source: str = "certificate"

    def __post_init__(self) -> None:
        if not (isinstance(self.eps, float | int) and self.eps == math.inf):
            check_non_negative("eps", self.eps)
        check_non_negative("delta", self.delta)
        if self.delta >= 1.0:
            raise ValueError(f"delta must be in [0, 1), got delta={self.delta!r}")


@dataclass(frozen=True, slots=True)
class Epoch:
    """What one epoch reveals about a user: independent parts, each a pair or a certificate.

    Usually one part: the dominating pair of the shuffled batch at the epoch's crowd
    (:meth:`from_pair`) or the mechanism's (ε, δ) certificate (:meth:`from_certificate`).

    Attributes:
        pairs: Dominating clone pairs (FMT21 eq. (20)) of independent parts of the view.
        certificates: (ε, δ) certificates of the other independent parts.
        neighbouring: The notion every part holds in (``removal``, ``replacement`` or,
            after :meth:`with_deletion`, ``add-remove``).
    """

    pairs: tuple[ClonePair, ...] = ()
    certificates: tuple[Certificate, ...] = ()
    neighbouring: Neighbouring = "removal"

    def __post_init__(self) -> None:
        if not self.pairs and not self.certificates:
            raise ValueError(
                "an epoch needs a pair or a certificate, got pairs=(), certificates=()"
            )
        for part in self.pairs:
            if not isinstance(part, ClonePair):
                raise ValueError(f"pairs must hold ClonePair values, got {part!r}")
        for cert in self.certificates:
            if not isinstance(cert, Certificate):
                raise ValueError(f"certificates must hold Certificate values, got {cert!r}")
        if self.neighbouring not in ("removal", "replacement", "add-remove"):
            raise ValueError(f"unknown neighbouring notion, got neighbouring={self.neighbouring!r}")

    @classmethod
    def from_pair(cls, pair: ClonePair, neighbouring: Neighbouring = "removal") -> Epoch:
        """One shuffled batch, dominated by ``pair`` (crowd ``pair.n_others + 1``)."""
        return cls(pairs=(pair,), neighbouring=neighbouring)

    @classmethod
    def from_certificate(
        cls,
        eps: float,
        delta: float,
        neighbouring: Neighbouring = "removal",
        source: str = "certificate",
    ) -> Epoch:
        """One batch of a mechanism without a dominating pair, as its (ε, δ) certificate."""
        return cls(certificates=(Certificate(eps, delta, source),), neighbouring=neighbouring)

    def as_replacement(self) -> Epoch:
        """The replacement statement of a removal epoch whose two steps are independent.

        Replacing x by x' is two removal steps (x -> reference -> x'). For mechanisms where
        the two steps touch independent parts of the output (k-RAPPOR: two attributes;
        the same argument as ``removal_to_replacement(independent_parts=True)`` in
        :mod:`.composition`), the view is dominated by two independent copies of each part.

        Raises:
            ValueError: if the epoch is not a removal statement.
        """
        if self.neighbouring != "removal":
            raise ValueError(f"epoch must be a removal statement, got {self.neighbouring!r}")
        return Epoch(self.pairs * 2, self.certificates * 2, "replacement")

    def with_deletion(self, eps_cr: float, delta_cr: float) -> Epoch:
        """Add the randomized-report-deletion part (ESA-revisited Algorithm 3).

        ESA-revisited Theorem V.1 proves only that the released crowd counts n̂ are
        (ε_cr, δ_cr)-DP for adding or removing a record. Given n̂ the shuffler keeps a uniform
        n̂-subset, which either misses the user (distributed as without the user) or holds the
        user in place of a random other record: a replacement pair (the argument of
        :func:`~common.accounting.composition.compose_with_deletion`). So an epoch whose parts
        are *replacement* statements at the crowd that survived, plus the (ε_cr, δ_cr)
        certificate of the counts, bounds the add/remove view; the composition treats the
        count as one more certificate part.

        Raises:
            ValueError: if the epoch is not a replacement statement, or on bad ε_cr, δ_cr.
        """
        check_positive("eps_cr", eps_cr)
        check_probability("delta_cr", delta_cr)
        if self.neighbouring != "replacement":
            raise ValueError(
                f"randomized deletion composes with a replacement statement (a refilled slot "
                f"is a replacement pair), got neighbouring={self.neighbouring!r}"
            )
        count = Certificate(eps_cr, delta_cr, "esa-thm-v1")
        return Epoch(self.pairs, (*self.certificates, count), "add-remove")


@dataclass(frozen=True, slots=True)
class DeltaSplit:
    """How the total δ is divided, per composition method.

    Attributes:
        certificates: Σ δ of the certificate parts (incl. deletion); spent in every method.
        pld_pairs: δ left to the pairs in the PLD composition (``delta - certificates``).
        pld_truncation: Of ``pld_pairs``, an upper bound on the mass charged as infinite loss
            for truncated tails (C window, x tails, dp_accounting's tail truncation).
        basic_per_part: δ of each pair part under basic composition.
        advanced_per_step: δ of every step under advanced composition.
        advanced_slack: δ' of advanced composition.
    """

    certificates: float
    pld_pairs: float
    pld_truncation: float
    basic_per_part: float
    advanced_per_step: float
    advanced_slack: float

    def as_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return {
            "certificates": self.certificates,
            "pld_pairs": self.pld_pairs,
            "pld_truncation": self.pld_truncation,
            "basic_per_part": self.basic_per_part,
            "advanced_per_step": self.advanced_per_step,
            "advanced_slack": self.advanced_slack,
        }


@dataclass(frozen=True, slots=True)
class LifetimeResult:
    """A user's lifetime (ε, δ) over all epochs in one ``neighbouring`` notion; ``note`` says how.

    Attributes:
        eps: The certified ε at total ``delta``: the smallest of ``eps_pld``, ``eps_basic`` and
            ``eps_advanced`` (``math.inf`` when some part certifies nothing); ``method`` names it.
        eps_pld, eps_basic, eps_advanced: PLD (dp_accounting, pessimistic), basic (Σ ε at Σ δ)
            and the best advanced composition, whose rule is ``advanced_rule``
            (``advanced-drv``, ``advanced-bun-steinke`` or ``basic``); ``delta_split`` says how
            each divides δ.
        parts, pair_parts: Composed parts (``epochs`` times parts per epoch), and how many of
            them are dominating pairs (the rest are certificates).
        discretization: The loss grid step h of the PLD.
    """

    eps: float
    delta: float
    method: str
    neighbouring: Neighbouring
    eps_pld: float
    eps_basic: float
    eps_advanced: float
    advanced_rule: str
    delta_split: DeltaSplit
    epochs: int
    parts: int
    pair_parts: int
    discretization: float
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (``esa account compose --json``); ∞ is written as null."""
        return {
            "eps": _finite_or_none(self.eps),
            "delta": self.delta,
            "method": self.method,
            "neighbouring": self.neighbouring,
            "eps_pld": _finite_or_none(self.eps_pld),
            "eps_basic": _finite_or_none(self.eps_basic),
            "eps_advanced": _finite_or_none(self.eps_advanced),
            "advanced_rule": self.advanced_rule,
            "delta_split": self.delta_split.as_dict(),
            "epochs": self.epochs,
            "parts": self.parts,
            "pair_parts": self.pair_parts,
            "discretization": self.discretization,
            "note": self.note,
        }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class _Losses:
    """Un-rounded loss atoms of one pair under P, with the mass charged as infinite loss."""

    losses: FloatArray
    masses: FloatArray
    infinity_mass: float
    variance: float


def _coarse_blocks(m: int, r: float, tail: float) -> tuple[IntArray, FloatArray, float]:
    """Blocks of clone counts (left ends, masses) and the mass of C outside the window.

    Starts from the exact window and blocks of :mod:`.hockey_stick` and merges neighbours so
    that a block is about ``sqrt(c)/PLD_SQRT_DIVISIONS`` wide; each is charged at its left end.
    """
    blocks = hockey_stick._blocks(m, r, tail)
    key = np.floor(np.sqrt(blocks.starts) * (2.0 * PLD_SQRT_DIVISIONS)).astype(np.int64)
    first = np.flatnonzero(np.diff(key, prepend=-1))
    masses = np.asarray(np.add.reduceat(blocks.masses, first), dtype=np.float64)
    return blocks.starts[first], masses, blocks.tail_mass


def _x_window(c: IntArray, tail: float) -> tuple[IntArray, IntArray, FloatArray, FloatArray]:
    """Per clone count: the window [lo, hi] of x and Hoeffding bounds on P's mass outside it.

    ``P_c(X < lo) <= Pr[A <= lo - 1] <= exp(-2 s²/c)`` with ``s = c/2 - lo + 1``, and
    ``P_c(X > hi) <= Pr[A >= hi] <= exp(-2 s²/c)`` with ``s = hi - c/2`` (A ~ Bin(c, 1/2)).
    The window always contains both points next to c/2, so both s are >= 1/2.
    """
    half = c / 2.0
    spread = np.sqrt(c * math.log(1.0 / tail) / 2.0)
    lo = np.clip(np.ceil(half + 1.0 - spread), 0, np.floor(half)).astype(np.int64)
    hi = np.clip(np.floor(half + spread), np.floor(half) + 1, c + 1).astype(np.int64)
    scale = np.maximum(c, 1).astype(np.float64)
    left = np.where(lo > 0, np.exp(-2.0 * (half - lo + 1.0) ** 2 / scale), 0.0)
    right = np.where(hi < c + 1, np.exp(-2.0 * (hi - half) ** 2 / scale), 0.0)
    return lo, hi, left, right


def _loss_and_mass(x: IntArray, c: IntArray, eps0: float) -> tuple[FloatArray, FloatArray]:
    """``L(x, c)`` and ``P_c(x)`` of FMT21 eq. (20) (docs/accounting.md, "Lifetime composition")."""
    q = 1.0 / (1.0 + math.exp(-eps0))
    p = 1.0 / (1.0 + math.exp(eps0))
    u = (c + 1 - x).astype(np.float64)
    v = x.astype(np.float64)
    upper = q * u + p * v
    lower = p * u + q * v
    losses = np.log(upper) - np.log(lower)
    masses = stats.binom.pmf(x, c + 1, 0.5) * 2.0 * upper / (c + 1)
    return np.asarray(losses, np.float64), np.asarray(masses, np.float64)


@lru_cache(maxsize=32)
def _pair_losses(pair: ClonePair, tail: float) -> _Losses:
    """Loss atoms of the blocked, truncated pair (a dominating pair of ``pair``)."""
    starts, block_mass, c_tail = _coarse_blocks(pair.n_others, pair.clone_prob, tail)
    lo, hi, left, right = _x_window(starts, tail)
    lengths = hi - lo + 1
    ends = np.cumsum(lengths)
    block = np.repeat(np.arange(starts.size), lengths)
    x = lo[block] + (np.arange(int(ends[-1])) - (ends - lengths)[block])
    losses, within = _loss_and_mass(x, starts[block], pair.eps0)
    masses = block_mass[block] * within
    masses[ends - 1] += block_mass * right
    infinity = c_tail + float(np.dot(block_mass, left))
    return _weighted(losses, masses, infinity, pair.weight)


def _weighted(losses: FloatArray, masses: FloatArray, infinity: float, weight: float) -> _Losses:
    """Mix in the uninformative component (an atom of zero loss, mass 1 - w) and inflate."""
    if weight < 1.0:
        losses = np.append(losses, 0.0)
        masses = np.append(masses * weight, 1.0 - weight)
        infinity *= weight
    masses = masses * (1.0 + MASS_SLACK)
    total = float(masses.sum())
    mean = float(np.dot(masses, losses)) / total
    variance = float(np.dot(masses, (losses - mean) ** 2)) / total
    return _Losses(losses, masses, min(infinity * (1.0 + MASS_SLACK), 1.0), variance)


@lru_cache(maxsize=64)
def _pair_pld(pair: ClonePair, tail: float, step: float) -> pld.PrivacyLossDistribution:
    """The pessimistic PLD of ``pair`` on the grid ``step·Z`` (symmetric: one direction)."""
    raw = _pair_losses(pair, tail)
    index = np.ceil((raw.losses + LOSS_SLACK) / step).astype(np.int64)
    lowest = int(index.min())
    probs = np.bincount(index - lowest, weights=raw.masses)
    pmf = pld_pmf.DensePLDPmf(step, lowest, probs, raw.infinity_mass, True)
    return pld.PrivacyLossDistribution(pmf)


def _certificate_pld(cert: Certificate, step: float) -> pld.PrivacyLossDistribution:
    params = pld_common.DifferentialPrivacyParameters(cert.eps, cert.delta)
    return pld.from_privacy_parameters(params, value_discretization_interval=step)


def _certificate_variance(cert: Certificate) -> float:
    """Variance of the ±ε loss of the canonical (ε, δ) pair."""
    return cert.eps**2 * (1.0 - math.tanh(cert.eps / 2.0) ** 2)


def _grid_step(raws: dict[ClonePair, tuple[_Losses, int]], certs: Counter[Certificate]) -> float:
    """The loss grid step h (see ``RESOLUTION``), clipped to the allowed range."""
    parts = sum(k for _, k in raws.values()) + sum(certs.values())
    variance = sum(raw.variance * k for raw, k in raws.values())
    variance += sum(_certificate_variance(c) * k for c, k in certs.items())
    step = math.sqrt(variance) / (RESOLUTION * parts)
    width = max((float(np.ptp(raw.losses)) for raw, _ in raws.values()), default=0.0)
    step = max(step, width / MAX_PMF_POINTS, MIN_DISCRETIZATION)
    return min(step, MAX_DISCRETIZATION)


def _compose_all(
    groups: list[tuple[pld.PrivacyLossDistribution, int]], truncation: float
) -> pld.PrivacyLossDistribution:
    """Self-compose each group, then compose the results pairwise (a balanced tree)."""
    plds = [p if k == 1 else p.self_compose(k, truncation) for p, k in groups]
    while len(plds) > 1:
        merged = [a.compose(b, truncation) for a, b in zip(plds[::2], plds[1::2], strict=False)]
        plds = merged + ([plds[-1]] if len(plds) % 2 else [])
    return plds[0]


def _pld_part(
    pairs: Counter[ClonePair], certs: Counter[Certificate], delta: float
) -> tuple[float, float, float]:
    """Lifetime ε by PLD composition, the grid step, and the δ charged for truncations."""
    parts = sum(pairs.values()) + sum(certs.values())
    budget = TRUNCATION_FRACTION * delta
    # Per pair part: C's two tails and P's left x tails, each <= tail; half the budget.
    tail = budget / (6.0 * parts)
    raws = {pair: (_pair_losses(pair, tail), k) for pair, k in pairs.items()}
    step = _grid_step(raws, certs)
    calls = 2 * (len(pairs) + len(certs))
    truncation = budget / (2.0 * calls)
    groups = [(_pair_pld(pair, tail, step), k) for pair, k in pairs.items()]
    groups += [(_certificate_pld(cert, step), k) for cert, k in certs.items()]
    eps = float(_compose_all(groups, truncation).get_epsilon_for_delta(delta))
    charged = sum(raw.infinity_mass * k for raw, k in raws.values()) + calls * truncation
    return eps, step, charged


def _basic_part(
    pairs: Counter[ClonePair], certs: Counter[Certificate], delta_free: float
) -> tuple[EpsDelta, float]:
    """Basic composition; each pair part gets ``delta_free / (pair parts)``."""
    pair_parts = sum(pairs.values())
    share = delta_free / pair_parts if pair_parts else 0.0
    steps = [(eps_for_delta(pair, share), share) for pair, k in pairs.items() for _ in range(k)]
    steps += [(c.eps, c.delta) for c, k in certs.items() for _ in range(k)]
    return basic_composition(steps), share


def _dominant_pairs(pairs: Counter[ClonePair]) -> list[ClonePair]:
    """Per (r, ε0, w), the pair with the fewest others: it has the largest ε at every δ.

    A pair with m' > m others is a post-processing of the pair with m others (the extra
    Bin(m' - m, r) clones add Bin(·, 1/2) to x), so its ε is no larger.
    """
    smallest: dict[tuple[float, float, float], ClonePair] = {}
    for pair in pairs:
        key = (pair.clone_prob, pair.eps0, pair.weight)
        if key not in smallest or pair.n_others < smallest[key].n_others:
            smallest[key] = pair
    return list(smallest.values())


def _advanced_part(
    pairs: Counter[ClonePair], certs: Counter[Certificate], delta: float
) -> tuple[EpsDelta, float, float]:
    """Best advanced composition over δ splits: every step is (ε_max, δ_step)-DP.

    With heterogeneous parts the largest per-part ε is used (the theorems are stated for
    k identical (ε, δ) steps); certificates need ``δ_step >= δ_i``. Returns the composition,
    the per-step δ and δ'.
    """
    steps = sum(pairs.values()) + sum(certs.values())
    cert_delta = max((c.delta for c in certs), default=0.0)
    cert_eps = max((c.eps for c in certs), default=0.0)
    candidates = [(f * delta, (1.0 - f) * delta / steps) for f in ADVANCED_SLACK_FRACTIONS]
    if cert_delta > 0.0:
        candidates.append((delta - steps * cert_delta, cert_delta))
    best: tuple[EpsDelta, float, float] | None = None
    dominant = _dominant_pairs(pairs)
    for slack, step in candidates:
        if slack <= 0.0 or step < cert_delta or step <= 0.0:
            continue
        eps_max = max([eps_for_delta(p, step) for p in dominant] + [cert_eps])
        result = best_composition(eps_max, step, steps, slack)
        if best is None or result.eps < best[0].eps:
            best = (result, step, slack)
    if best is None:
        return EpsDelta(math.inf, delta, "advanced", "no δ split leaves room"), 0.0, 0.0
    return best


def _check_epochs(epochs: Sequence[Epoch]) -> tuple[tuple[Epoch, ...], Neighbouring]:
    """The epochs as a tuple and their common neighbouring notion."""
    if isinstance(epochs, Epoch) or not isinstance(epochs, Sequence) or not epochs:
        raise ValueError(f"epochs must be a non-empty sequence of Epoch, got epochs={epochs!r}")
    for epoch in epochs:
        if not isinstance(epoch, Epoch):
            raise ValueError(f"epochs must hold Epoch values, got {epoch!r}")
    notions = {epoch.neighbouring for epoch in epochs}
    if len(notions) != 1:
        raise ValueError(
            f"all epochs must hold in one neighbouring notion, got {sorted(notions)!r}"
        )
    return tuple(epochs), notions.pop()


def _no_bound(
    delta: float, notion: Neighbouring, epochs: int, parts: int, pair_parts: int
) -> LifetimeResult:
    split = DeltaSplit(
        certificates=0.0,
        pld_pairs=0.0,
        pld_truncation=0.0,
        basic_per_part=0.0,
        advanced_per_step=0.0,
        advanced_slack=0.0,
    )
    note = "a part certifies no finite ε (e.g. zsum below its declared crowd)"
    inf = math.inf
    return LifetimeResult(
        eps=inf,
        delta=delta,
        method="none",
        neighbouring=notion,
        eps_pld=inf,
        eps_basic=inf,
        eps_advanced=inf,
        advanced_rule="none",
        delta_split=split,
        epochs=epochs,
        parts=parts,
        pair_parts=pair_parts,
        discretization=0.0,
        note=note,
    )


def _certificates_delta(certs: Counter[Certificate], delta: float) -> float:
    """Σ δ of the certificate parts, which must leave some of ``delta`` to the pairs."""
    spent = float(sum(c.delta * k for c, k in certs.items()))
    if spent >= delta:
        raise ValueError(
            f"delta must exceed the certificates' total δ = {spent:g}, got delta={delta}"
        )
    return spent


def compose_epochs(epochs: Sequence[Epoch], delta: float) -> LifetimeResult:
    """A user's lifetime (ε, δ): PLD composition of every epoch, beside basic and advanced.

    Pair parts compose as dp_accounting PLDs (pessimistic; dominating pairs compose:
    Zhu–Dong–Wang 2022 Theorem 10; FFT composition: Koskela et al. 2020), certificates through
    ``from_privacy_parameters``; basic and advanced composition (EFMRTT19 Theorem 2,
    ESA-revisited Theorem II.7) split δ explicitly. The reported ε is the smallest of the three;
    each holds at total δ <= ``delta``. Construction and δ splits: docs/accounting.md,
    "Lifetime composition (PLD)".

    Raises:
        ValueError: on an empty or mixed list of epochs (one neighbouring notion), δ outside
            (0, 1), or certificates whose δ add up to ``delta`` or more.
    """
    delta = check_probability("delta", delta)
    epochs, notion = _check_epochs(epochs)
    pairs = Counter(pair for epoch in epochs for pair in epoch.pairs)
    certs = Counter(cert for epoch in epochs for cert in epoch.certificates)
    parts = sum(pairs.values()) + sum(certs.values())
    cert_delta = _certificates_delta(certs, delta)
    if any(math.isinf(c.eps) for c in certs):
        return _no_bound(delta, notion, len(epochs), parts, sum(pairs.values()))
    eps_pld, step, charged = _pld_part(pairs, certs, delta)
    basic, share = _basic_part(pairs, certs, delta - cert_delta)
    advanced, adv_step, adv_slack = _advanced_part(pairs, certs, delta)
    split = DeltaSplit(
        certificates=cert_delta,
        pld_pairs=delta - cert_delta,
        pld_truncation=charged,
        basic_per_part=share,
        advanced_per_step=adv_step,
        advanced_slack=adv_slack,
    )
    options = [(eps_pld, "pld"), (basic.eps, "basic"), (advanced.eps, advanced.rule)]
    eps, method = min(options, key=lambda option: option[0])
    note = (
        f"PLD composition of {parts} parts (dp_accounting, pessimistic, h = {step:.3g}); "
        f"basic and advanced composition for reference"
    )
    return LifetimeResult(
        eps=eps,
        delta=delta,
        method=method,
        neighbouring=notion,
        eps_pld=eps_pld,
        eps_basic=basic.eps,
        eps_advanced=advanced.eps,
        advanced_rule=advanced.rule,
        delta_split=split,
        epochs=len(epochs),
        parts=parts,
        pair_parts=sum(pairs.values()),
        discretization=step,
        note=note,
    )


def _check_crowds(crowds: Sequence[int]) -> tuple[int, ...]:
    if isinstance(crowds, str | bytes) or not isinstance(crowds, Sequence) or not crowds:
        raise ValueError(f"crowds must be a non-empty sequence of counts, got crowds={crowds!r}")
    return tuple(check_count("crowd", crowd) for crowd in crowds)


def _snapped(crowds: tuple[int, ...]) -> tuple[int, ...]:
    """The crowds, rounded down to a relative grid when there are many distinct ones.

    Fewer others dominate more (the pair with m' > m others is a post-processing of the pair
    with m), so charging an epoch at a smaller crowd keeps the bound certified.
    """
    if len(set(crowds)) <= MAX_EXACT_CROWDS:
        return crowds
    return tuple(n - n % (1 << max(0, n.bit_length() - 1 - CROWD_GRID_BITS)) for n in crowds)


def charged_crowds(crowds: Sequence[int]) -> tuple[int, ...]:
    """The crowd each epoch is charged at (what :func:`lifetime_for_mechanism` composes).

    The crowds as given, or, with more than ``MAX_EXACT_CROWDS`` distinct ones, each rounded
    down to a relative grid (``CROWD_GRID_BITS``) so that epochs share PLDs. A smaller crowd
    dominates a larger one (the pair with m' > m others is a post-processing of the pair with
    m others, FMT21 Lemma E.2's argument), so the bound stays certified.

    Raises:
        ValueError: on an empty sequence or a crowd below 1.
    """
    return _snapped(_check_crowds(crowds))


def _no_worse(a: ClonePair, b: ClonePair) -> bool:
    """True if pair ``a`` is a post-processing of pair ``b`` (so its ε is no larger at any δ).

    More others, a larger clone probability (``C' = C + Bin(m - C, (r' - r)/(1 - r))``), a
    smaller ε0 (binary RR at a smaller ε0 post-processes RR at a larger one) and a smaller
    informative weight (reveal the uninformative case more often) each post-process.
    """
    return (
        a.n_others >= b.n_others
        and a.clone_prob >= b.clone_prob
        and a.eps0 <= b.eps0
        and a.weight <= b.weight
    )


@lru_cache(maxsize=4096)
def _best_pair(
    randomizer: LocalRandomizer, eps0: float, crowd: int, delta: float
) -> ClonePair | None:
    """Among the mechanism's dominating pairs at ``crowd``, the one with the smallest ε at δ.

    Pairs another pair post-processes are dropped first (:func:`_no_worse`), so the numerical
    comparison runs only when the families do not order (k-RR at a small ε0 against the
    generic clones pair). None when the mechanism has no dominating pair.
    """
    wanted = randomizer.applicable(None)
    candidates = [
        spec.pair(eps0, crowd)
        for spec in randomizer.methods()
        if spec.pair is not None and spec.method in wanted
    ]
    kept = [
        pair
        for i, pair in enumerate(candidates)
        if not any(
            _no_worse(other, pair) and (other != pair or j < i)
            for j, other in enumerate(candidates)
            if j != i
        )
    ]
    if not kept:
        return None
    if len(kept) == 1:
        return kept[0]
    return min(kept, key=lambda pair: eps_for_delta(pair, delta))


def mechanism_epoch(
    randomizer: LocalRandomizer,
    eps0: float,
    crowd: int,
    delta: float,
    *,
    deletion: tuple[float, float] | None = None,
    replacement: bool = False,
) -> Epoch | None:
    """One shuffled epoch of ``randomizer`` at ``crowd`` as its dominating pair, or None.

    The pair is the one of the randomizer's methods with the smallest one-epoch ε at ``delta``
    (blanket pair for binary RR, Balle et al. 2019; k-RR pair with its weight, FMT21 §4.1;
    generic clones pair, FMT21 Remark 3.5, eq. (20)), in the natural neighbouring notion.
    ``deletion`` = (ε_cr, δ_cr) gives the add/remove statement (ESA-revisited Theorem V.1);
    ``replacement`` states a removal epoch in the replacement notion. ``eps0`` is the local ε of
    :func:`~common.accounting.randomizers.certify`, ``crowd`` the epoch's smallest shuffled
    batch, ``delta`` the epoch's share of the lifetime δ.

    Returns None for a randomizer without a dominating pair (Balcer–Cheu; generic with
    δ0 > 0): compose its (ε, δ) certificate instead. Raises ValueError naming a bad argument.
    """
    randomizer = check_randomizer(randomizer)
    eps0 = check_positive("eps0", eps0)
    crowd = check_count("crowd", crowd)
    delta = check_probability("delta", delta)
    pair = _best_pair(randomizer, eps0, crowd, delta)
    if pair is None:
        return None
    epoch = Epoch.from_pair(pair, randomizer.natural)
    if deletion is not None:
        return _with_deletion(epoch, deletion)
    if replacement and epoch.neighbouring == "removal":
        return epoch.as_replacement()
    return epoch


def _certificate_epoch(randomizer: LocalRandomizer, eps0: float, crowd: int, delta: float) -> Epoch:
    certified = certify(randomizer, eps0, crowd, delta).certified
    notion = randomizer.natural
    return Epoch.from_certificate(certified.eps, certified.delta, notion, str(certified.method))


def _mechanism_epochs(
    randomizer: LocalRandomizer,
    eps0: float,
    crowds: tuple[int, ...],
    delta: float,
    deletion: tuple[float, float] | None,
) -> list[Epoch]:
    """One epoch per crowd: the best dominating pair at that crowd (:func:`mechanism_epoch`,
    compared at ``delta / T``), else the certificate at ``CERTIFICATE_SHARE · delta / T``."""
    share = delta / len(crowds)
    pairs = {n: mechanism_epoch(randomizer, eps0, n, share, deletion=deletion) for n in set(crowds)}
    ready = [epoch for epoch in (pairs[n] for n in crowds) if epoch is not None]
    if len(ready) == len(crowds):
        return ready
    certificate_share = CERTIFICATE_SHARE * share
    epochs = [_certificate_epoch(randomizer, eps0, n, certificate_share) for n in crowds]
    if deletion is not None:
        epochs = [_with_deletion(epoch, deletion) for epoch in epochs]
    return epochs


def _with_deletion(epoch: Epoch, deletion: tuple[float, float]) -> Epoch:
    content = epoch if epoch.neighbouring == "replacement" else epoch.as_replacement()
    return content.with_deletion(*deletion)


def lifetime_for_mechanism(
    randomizer: LocalRandomizer,
    eps0: float,
    crowds: Sequence[int],
    delta: float,
    *,
    deletion: tuple[float, float] | None = None,
) -> LifetimeResult:
    """Lifetime (ε, δ) of one channel whose reports ``randomizer`` describes, once per epoch.

    Each epoch is :func:`mechanism_epoch` at that epoch's crowd and ``δ / T``, or the
    randomizer's certificate at ``CERTIFICATE_SHARE · δ / T`` when it has no dominating pair;
    crowds (one per epoch) are charged as :func:`charged_crowds` says. ``deletion`` = (ε_cr,
    δ_cr) per epoch gives the add/remove statement (ESA-revisited Theorem V.1). Details:
    docs/accounting.md, "Lifetime composition (PLD)".

    Returns the :class:`LifetimeResult` of :func:`compose_epochs`; raises ValueError naming a
    bad argument.
    """
    randomizer = check_randomizer(randomizer)
    crowds = _check_crowds(crowds)
    eps0 = check_positive("eps0", eps0)
    delta = check_probability("delta", delta)
    free = _delta_left(delta, len(crowds), deletion)
    charged = _snapped(crowds)
    epochs = _mechanism_epochs(randomizer, eps0, charged, free, deletion)
    result = compose_epochs(epochs, delta)
    if charged == crowds:
        return result
    note = f"{len(set(crowds))} distinct crowds charged at {len(set(charged))} (rounded down)"
    return replace(result, note=f"{result.note}; {note}")


def _delta_left(delta: float, epochs: int, deletion: tuple[float, float] | None) -> float:
    """δ left for the epochs' own statements once deletion's δ_cr per epoch is set aside."""
    if deletion is None:
        return delta
    check_positive("eps_cr", deletion[0])
    check_probability("delta_cr", deletion[1])
    free = delta - epochs * deletion[1]
    if free <= 0.0:
        raise ValueError(
            f"delta_cr times the number of epochs must stay below delta={delta}, "
            f"got delta_cr={deletion[1]}"
        )
    return free


def _bracket(certifies: Callable[[float], bool], start: float) -> tuple[float | None, float | None]:
    """(good, bad): ``certifies(good)`` and not ``certifies(bad)``, by halving or doubling.

    ``bad`` is None when even ``EPS0_MAX`` certifies; ``good`` is None when nothing above
    1e-9 does.
    """
    if certifies(start):
        good = start
        while 2.0 * good < EPS0_MAX and certifies(2.0 * good):
            good *= 2.0
        bad = min(2.0 * good, EPS0_MAX)
        return (good, bad) if bad > good and not certifies(bad) else (good, None)
    bad = start
    while bad > 1e-9:
        if certifies(bad / 2.0):
            return bad / 2.0, bad
        bad /= 2.0
    return None, bad


def plan_eps0_lifetime(
    target_eps: float,
    delta: float,
    n: int,
    epochs: int,
    randomizer: LocalRandomizer,
) -> float:
    """Largest ε0 whose lifetime ε over ``epochs`` epochs of crowd ``n`` is <= ``target_eps``.

    Bisection on ε0 over :func:`lifetime_for_mechanism` (monotone in ε0) to within
    ``PLAN_TOLERANCE``, returning the certified left end of the final bracket, capped at the
    planner's ``EPS0_MAX``: ``lifetime_for_mechanism(..., eps0, [n] * epochs, delta).eps <=
    target_eps`` holds for it. Why monotone: docs/accounting.md, "Planning ε0".

    Raises:
        ValueError: on bad arguments, or when no ε0 > 0 certifies the target.
    """
    target_eps = check_positive("target_eps", target_eps)
    delta = check_probability("delta", delta)
    n = check_count("n", n)
    epochs = check_count("epochs", epochs)
    randomizer = check_randomizer(randomizer)
    crowds = (n,) * epochs

    def certifies(eps0: float) -> bool:
        return lifetime_for_mechanism(randomizer, eps0, crowds, delta).eps <= target_eps

    good, bad = _bracket(certifies, min(target_eps / epochs, EPS0_MAX))
    if bad is None:
        return EPS0_MAX
    if good is None:
        raise ValueError(
            f"no eps0 > 0 certifies target_eps={target_eps} over epochs={epochs} "
            f"at delta={delta}, n={n} for {randomizer.kind}"
        )
    while bad - good > PLAN_TOLERANCE:
        mid = 0.5 * (good + bad)
        good, bad = (mid, bad) if certifies(mid) else (good, mid)
    return good
