"""Composition, subsampling, randomized report deletion and neighbouring conversions.

Sources: basic composition (Dwork–Roth Thm 3.16); advanced composition in the form of
Erlingsson et al. 2019, Theorem 2 (Dwork–Rothblum–Vadhan) and in the sharper form of
ESA-revisited Theorem II.7 (Bun–Steinke, Corollary 8.11); amplification by subsampling,
Erlingsson et al. 2019, Lemma 4; randomized report deletion, ESA-revisited Algorithm 3 and
Theorems V.1–V.2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from common.accounting._checks import (
    check_count,
    check_non_negative,
    check_positive,
    check_probability,
    check_unit_interval,
)
from common.accounting.results import BoundResult


@dataclass(frozen=True, slots=True)
class EpsDelta:
    """An (ε, δ) pair produced by a composition rule, with the rule's name."""

    eps: float
    delta: float
    rule: str
    note: str = ""


def basic_composition(parts: Sequence[tuple[float, float]]) -> EpsDelta:
    """Basic (adaptive) composition: ``(Σ ε_i, Σ δ_i)``.

    Raises:
        ValueError: if ``parts`` is empty or a part has a negative ε or δ outside [0, 1].
    """
    if not parts:
        raise ValueError("parts must hold at least one (eps, delta) pair, got parts=[]")
    eps = sum(check_non_negative("eps", e) for e, _ in parts)
    delta = sum(check_unit_interval("delta", d) for _, d in parts)
    return EpsDelta(eps, min(delta, 1.0), "basic")


def advanced_composition_drv(eps: float, delta: float, k: int, delta_prime: float) -> EpsDelta:
    """Erlingsson et al. 2019, Theorem 2: k-fold adaptive composition of (ε, δ)-DP steps.

    ``(ε sqrt(2k log(1/δ')) + k ε (e^ε - 1), k δ + δ')``.
    """
    eps = check_non_negative("eps", eps)
    delta = check_unit_interval("delta", delta)
    k = check_count("k", k)
    delta_prime = check_probability("delta_prime", delta_prime)
    value = eps * math.sqrt(2.0 * k * math.log(1.0 / delta_prime)) + k * eps * math.expm1(eps)
    return EpsDelta(value, min(k * delta + delta_prime, 1.0), "advanced-drv")


def advanced_composition_bun_steinke(
    eps: float, delta: float, k: int, delta_prime: float
) -> EpsDelta:
    """ESA-revisited Theorem II.7 (Bun–Steinke): ``(k ε²/2 + sqrt(k) ε sqrt(2 log(sqrt(kπ/2)
    ε / δ')), δ' + k δ)``.

    The square root needs ``sqrt(kπ/2) ε / δ' >= 1``; below that the theorem says nothing and
    basic composition is returned instead, with a note.
    """
    eps = check_non_negative("eps", eps)
    delta = check_unit_interval("delta", delta)
    k = check_count("k", k)
    delta_prime = check_probability("delta_prime", delta_prime)
    argument = math.sqrt(k * math.pi / 2.0) * eps / delta_prime
    if argument < 1.0:
        fallback = basic_composition([(eps, delta)] * k)
        return replace(fallback, note="Theorem II.7 needs sqrt(kπ/2) ε/δ' >= 1; basic used")
    value = k * eps**2 / 2.0 + math.sqrt(k) * eps * math.sqrt(2.0 * math.log(argument))
    return EpsDelta(value, min(delta_prime + k * delta, 1.0), "advanced-bun-steinke")


def best_composition(eps: float, delta: float, k: int, delta_prime: float) -> EpsDelta:
    """The smallest ε among basic, DRV and Bun–Steinke composition of k (ε, δ) steps.

    Basic composition uses no δ'; the advanced forms spend ``delta_prime`` extra.
    """
    options = [
        basic_composition([(eps, delta)] * check_count("k", k)),
        advanced_composition_drv(eps, delta, k, delta_prime),
        advanced_composition_bun_steinke(eps, delta, k, delta_prime),
    ]
    return min(options, key=lambda option: option.eps)


def subsample(eps: float, delta: float, q: float) -> EpsDelta:
    """Erlingsson et al. 2019, Lemma 4: ``(log(1 + q(e^ε - 1)), q δ)`` for ``q < 1/2``.

    Raises:
        ValueError: if q is not in (0, 1/2).
    """
    eps = check_non_negative("eps", eps)
    delta = check_unit_interval("delta", delta)
    q = check_probability("q", q)
    if q >= 0.5:
        raise ValueError(f"q must be < 1/2 (Lemma 4), got q={q}")
    return EpsDelta(math.log1p(q * math.expm1(eps)), q * delta, "subsampling")


def deletion_offset(eps_cr: float, delta_cr: float) -> float:
    """ESA-revisited Algorithm 3 line 3: the shift ``(2/ε_cr) log(2/δ_cr)``."""
    eps_cr = check_positive("eps_cr", eps_cr)
    delta_cr = check_probability("delta_cr", delta_cr)
    return 2.0 / eps_cr * math.log(2.0 / delta_cr)


def deletion_utility_bound(eps_cr: float, delta_cr: float, crowds: int) -> float:
    """ESA-revisited Theorem V.2: w.p. >= 1 - δ_cr at most ``(4/ε_cr) log(2P/δ_cr)`` records
    are deleted from any of the ``P`` crowds."""
    eps_cr = check_positive("eps_cr", eps_cr)
    delta_cr = check_probability("delta_cr", delta_cr)
    crowds = check_count("crowds", crowds)
    return 4.0 / eps_cr * math.log(2.0 * crowds / delta_cr)


def compose_with_deletion(content: BoundResult, eps_cr: float, delta_cr: float) -> BoundResult:
    """Add/remove guarantee of a release after randomized report deletion (Theorem V.1).

    Algorithm 3 makes the released crowd count n̂ (ε_cr, δ_cr)-DP for adding or removing a
    record (ESA-revisited Theorem V.1). Given n̂, the shuffler keeps a uniform n̂-subset: with
    the user present, that subset either misses the user (distributed exactly as without the
    user) or holds the user in place of a random other record — a *replacement* pair. So the
    content is covered by the content's replacement certificate (evaluated at the crowd that
    survived), and basic composition gives ``(ε_rep + ε_cr, δ_rep + δ_cr)`` for add/remove.

    Raises:
        ValueError: if ``content`` is not a replacement statement.
    """
    if content.neighbouring != "replacement":
        raise ValueError(
            f"content must be a replacement statement (a deleted-then-refilled slot is a "
            f"replacement pair), got {content.neighbouring!r}"
        )
    eps_cr = check_non_negative("eps_cr", eps_cr)
    delta_cr = check_unit_interval("delta_cr", delta_cr)
    return replace(
        content,
        eps=content.eps + eps_cr,
        delta=min(content.delta + delta_cr, 1.0),
        neighbouring="add-remove",
    ).with_note(f"composed with randomized deletion (ε_cr={eps_cr:g}, δ_cr={delta_cr:g})")


def removal_to_replacement(result: BoundResult, *, independent_parts: bool) -> BoundResult:
    """Turn a removal statement into a replacement one.

    Replacing x by x' is two removal steps (x -> reference -> x'). When the two steps touch
    independent parts of the output (k-RAPPOR: two different attribute counts, each built from
    independent per-bit randomness) basic composition gives ``(2ε, 2δ)``; otherwise group
    privacy gives ``(2ε, (1 + e^ε) δ)``.
    """
    if result.neighbouring != "removal":
        raise ValueError(f"result must be a removal statement, got {result.neighbouring!r}")
    factor = 2.0 if independent_parts else 1.0 + math.exp(result.eps)
    rule = "two independent parts, basic composition" if independent_parts else "group privacy"
    return replace(
        result,
        eps=2.0 * result.eps,
        delta=min(factor * result.delta, 1.0),
        neighbouring="replacement",
    ).with_note(f"replacement from removal ({rule})")


def replacement_to_removal(result: BoundResult) -> BoundResult:
    """Turn a replacement statement into a removal one.

    Valid when the removal reference distribution is the randomizer's output on some input
    (or a mixture of outputs, by joint convexity of the hockey-stick divergence), as for k-RR
    with the uniform reference: then every removal pair is (a mixture of) replacement pairs.
    """
    if result.neighbouring != "replacement":
        raise ValueError(f"result must be a replacement statement, got {result.neighbouring!r}")
    return replace(result, neighbouring="removal").with_note(
        "removal from replacement (reference is a mixture of outputs)"
    )
