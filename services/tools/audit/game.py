"""Check 8, empirical privacy: a distinguishing game on neighbouring canary populations through
the real shuffler, and a Clopper–Pearson lower bound on ε from its outcome (StatDP / DP-Sniper;
Steinke, Nasr and Jagielski's one-run auditing, with independent trials).

Each full canary group is one trial on FMT21 Appendix F's pair: the target reports binary RR of
a secret coin, the others RR of 0. Two distinguishers fixed in advance (the count of ones, and
"the first fragment reads 1") give, Bonferroni over both and both rates,

    ε_lower = max(ln((TPR_lo − δ) / FPR_hi), ln((1 − FPR_hi − δ) / (1 − TPR_lo)))

beside binary RR's certified ε at the smallest released crowd; the check fails when the bound at
1 − 1e-7 exceeds it. Trials pool over epochs and saved runs (:func:`pool`; why pooling stays
valid: docs/audit.md, "Limits").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from scipy import stats

from common.accounting import KaryRR, certify
from services.tools.audit.checks import ALPHA, Finding, ReassembledBatch

CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Trial:
    """One group: the secret bit, and the released reports in batch order (None: no batch)."""

    secret: int
    reports: tuple[int, ...] | None
    n_contributions: int
    fragments_per_report: int


def rr_one_probability(value: int, eps0: float) -> float:
    """P(binary RR with ε0 reports 1 | value)."""
    keep = math.exp(eps0) / (math.exp(eps0) + 1)
    return keep if value == 1 else 1 - keep


@lru_cache(maxsize=256)
def count_threshold(n: int, eps0: float, per_class: int, delta: float, confidence: float) -> int:
    """The number of ones t at or above which the count distinguisher guesses 1: the t whose
    model rates (FMT21 eq. (22): X0 gives Bin(n, p) ones, X1 gives Bin(n−1, p) + Bern(1−p))
    give the largest ε lower bound at ``per_class`` trials of each secret. Chosen from the
    model alone, never from the data, so the bound stays valid."""
    p = rr_one_probability(0, eps0)
    best, best_eps = n + 1, -1.0
    for t in range(n + 1):
        fpr = float(stats.binom.sf(t - 1, n, p))
        tpr = float((1 - p) * stats.binom.sf(t - 2, n - 1, p) + p * stats.binom.sf(t - 1, n - 1, p))
        expected = [(1, 1)] * round(tpr * per_class) + [(1, 0)] * (
            per_class - round(tpr * per_class)
        )
        expected += [(0, 1)] * round(fpr * per_class) + [(0, 0)] * (
            per_class - round(fpr * per_class)
        )
        value = eps_lower(expected, delta, confidence)
        if value > best_eps:
            best, best_eps = t, value
    return best


def count_guess(trial: Trial, threshold: int) -> int:
    """Guess 1 when the batch holds at least ``threshold`` reports of 1."""
    if trial.reports is None:
        return 0
    return int(round(sum(trial.reports) / trial.fragments_per_report) >= threshold)


def first_guess(trial: Trial) -> int:
    """Guess 1 when the batch's first fragment reads 1."""
    return int(bool(trial.reports) and trial.reports is not None and trial.reports[0] == 1)


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds (lower, upper), each holding with ``confidence``."""
    alpha = 1 - confidence
    lower = (
        0.0 if successes == 0 else float(stats.beta.ppf(alpha, successes, trials - successes + 1))
    )
    upper = (
        1.0
        if successes == trials
        else float(stats.beta.ppf(1 - alpha, successes + 1, trials - successes))
    )
    return lower, upper


def eps_lower(guesses: Sequence[tuple[int, int]], delta: float, confidence: float) -> float:
    """ε lower bound from (secret, guess) pairs; each rate bound holds with ``confidence``."""
    positives = [g for s, g in guesses if s == 1]
    negatives = [g for s, g in guesses if s == 0]
    if not positives or not negatives:
        return 0.0
    tpr_lo, _ = clopper_pearson(sum(positives), len(positives), confidence)
    _, fpr_hi = clopper_pearson(sum(negatives), len(negatives), confidence)
    candidates = [0.0]
    if tpr_lo - delta > 0 and fpr_hi > 0:
        candidates.append(math.log((tpr_lo - delta) / fpr_hi))
    if 1 - fpr_hi - delta > 0 and tpr_lo < 1:
        candidates.append(math.log((1 - fpr_hi - delta) / (1 - tpr_lo)))
    return max(candidates)


def trials_from(
    batches: Sequence[ReassembledBatch], secrets: Mapping[str, int], fragments: int
) -> list[Trial]:
    """One trial per group with a secret: its released reports in position order."""
    by_crowd = {b.crowd_id: b for b in batches}
    trials = []
    for crowd, secret in secrets.items():
        batch = by_crowd.get(crowd)
        if batch is None:
            trials.append(Trial(secret, None, 0, fragments))
            continue
        reports = tuple(m.report for _, m in sorted(batch.canaries, key=lambda pm: pm[0]))
        trials.append(Trial(secret, reports, batch.n_contributions, fragments))
    return trials


def _bounds(
    trials: Sequence[Trial], thresholds: Mapping[int, int], delta: float, confidence: float
) -> dict[str, float]:
    """ε_lower of both distinguishers, jointly at ``confidence`` (Bonferroni over four rates);
    the count distinguisher uses the threshold fitted to each trial's released crowd."""
    per_rate = 1 - (1 - confidence) / 4
    counted = [(t.secret, count_guess(t, thresholds.get(t.n_contributions, 0))) for t in trials]
    return {
        "count": eps_lower(counted, delta, per_rate),
        "first": eps_lower([(t.secret, first_guess(t)) for t in trials], delta, per_rate),
    }


def privacy_game(trials: Sequence[Trial], eps0: float, delta: float) -> Finding:
    """ε_lower at 95% over both distinguishers, printed beside the certified ε at the smallest
    released crowd (the count threshold is fitted to each released crowd); the check fails
    when even the ε_lower at confidence 1 − :data:`~services.tools.audit.checks.ALPHA`
    exceeds the certified ε, so a correct shuffler fails it with probability below ALPHA,
    like every other check."""
    released = [t.n_contributions for t in trials if t.reports is not None]
    if not released:
        return Finding(
            check="privacy",
            name="distinguishing_game",
            passed=True,
            detail="no group released",
        )
    crowd = min(released)
    per_rate, per_class = 1 - (1 - CONFIDENCE) / 4, max(1, len(trials) // 2)
    thresholds = {n: count_threshold(n, eps0, per_class, delta, per_rate) for n in set(released)}
    threshold = thresholds[crowd]
    shown = _bounds(trials, thresholds, delta, CONFIDENCE)
    strict = max(_bounds(trials, thresholds, delta, 1 - ALPHA).values())
    certified = certify(KaryRR(k=2), eps0, crowd, delta).certified.eps
    lower = max(shown.values())
    detail = (
        f"ε_lower={lower:.3f} at 95% (count ≥ {threshold} at crowd {crowd}: "
        f"{shown['count']:.3f}, first: "
        f"{shown['first']:.3f}; {strict:.3f} at 1−{ALPHA:g}) over {len(trials)} groups vs "
        f"certified ε={certified:.3f} (binary RR ε0={eps0}, crowd {crowd}, δ={delta:g})"
    )
    finding = Finding(
        check="privacy",
        name="distinguishing_game",
        passed=strict <= certified,
        statistic=lower,
        p_value=None,
        detail=detail,
    )
    finding.plot = {"kind": "game", "bounds": shown, "certified": certified}
    return finding


class PoolError(ValueError):
    """Saved game outcomes that cannot be pooled (named file or value in the message)."""


def outcomes(trials: Sequence[Trial], eps0: float, delta: float, run: str) -> dict[str, Any]:
    """The game's outcome as saved in ``audit.json`` (``summary.game``): enough to pool it."""
    return {
        "eps0": eps0,
        "delta": delta,
        "run": run,
        "trials": [
            {
                "secret": t.secret,
                "reports": None if t.reports is None else "".join(map(str, t.reports)),
                "n_contributions": t.n_contributions,
                "fragments_per_report": t.fragments_per_report,
            }
            for t in trials
        ],
    }


def load_outcomes(data: Mapping[str, Any]) -> tuple[float, float, str, list[Trial]]:
    """(ε0, δ, run tag, trials) from :func:`outcomes`' dictionary.

    Raises:
        PoolError: a field is missing or malformed.
    """
    try:
        trials = [
            Trial(
                int(t["secret"]),
                None if t["reports"] is None else tuple(int(c) for c in t["reports"]),
                int(t["n_contributions"]),
                int(t["fragments_per_report"]),
            )
            for t in data["trials"]
        ]
        return float(data["eps0"]), float(data["delta"]), str(data["run"]), trials
    except (KeyError, TypeError, ValueError) as error:
        raise PoolError(f"malformed game outcome: {error!r}") from error


def pool(saved: Iterable[tuple[str, Mapping[str, Any]]]) -> tuple[Finding, int]:
    """One privacy-game finding over the trials of several saved runs (name, outcome), and
    the number of runs pooled.

    Raises:
        PoolError: runs with different ε0 or δ, the same run twice (its trials would not be
            independent), or a malformed outcome.
    """
    saved = list(saved)
    if any("mechanism" in data for _, data in saved):
        return _pool_mechanism(saved)
    settings: set[tuple[float, float]] = set()
    runs: dict[str, str] = {}
    trials: list[Trial] = []
    for name, data in saved:
        eps0, delta, run, found = load_outcomes(data)
        if run in runs:
            raise PoolError(f"{name} holds run {run!r} already pooled from {runs[run]}")
        runs[run] = name
        settings.add((eps0, delta))
        trials += found
    if len(settings) != 1:
        raise PoolError(f"runs with different game settings (ε0, δ): {sorted(settings)}")
    ((eps0, delta),) = settings
    return privacy_game(trials, eps0, delta), len(runs)


def _pool_mechanism(saved: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[Finding, int]:
    """:func:`pool` for games of a channel's mechanism (:mod:`~services.tools.audit.mechgame`):
    every run must have played the same channel (mechanism, parameters and δ)."""
    from services.tools.audit import mechgame

    games: set[mechgame.MechanismGame] = set()
    runs: dict[str, str] = {}
    trials: list[mechgame.MechTrial] = []
    for name, data in saved:
        if "mechanism" not in data:
            raise PoolError(f"{name} played binary RR, the others a channel's mechanism")
        try:
            game, run, found = mechgame.load_outcomes(data)
        except mechgame.GameError as error:
            raise PoolError(f"{name}: {error}") from error
        if run in runs:
            raise PoolError(f"{name} holds run {run!r} already pooled from {runs[run]}")
        runs[run] = name
        games.add(game)
        trials += found
    if len(games) != 1:
        raise PoolError(f"runs with different game settings: {sorted(g.describe() for g in games)}")
    return mechgame.mechanism_game(trials, games.pop()), len(runs)
