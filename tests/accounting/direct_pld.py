"""Independent reference computations for lifetime accounting (tests and benchmarks/lifetime.py).

Nothing here uses :mod:`common.accounting.lifetime`: the pairs are written out from FMT21
eq. (20) and Appendix F and handed to dp_accounting's generic
``from_two_probability_mass_functions``, one dictionary entry per outcome.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld
from scipy import stats


def _window(trials: int, p: float, sigmas: float) -> range:
    mean = trials * p
    spread = sigmas * math.sqrt(max(trials * p * (1.0 - p), 1.0))
    return range(max(0, math.floor(mean - spread)), min(trials, math.ceil(mean + spread)) + 1)


def blanket_pair_log_pmfs(
    n: int, eps0: float, sigmas: float = 10.0
) -> tuple[dict[object, float], dict[object, float]]:
    """Log-pmfs of the blanket pair (FMT21 eq. (20), r = 2/(e^ε0+1)) over outcomes (x, c).

    Outcomes are kept within ``sigmas`` standard deviations of C and of x given c; the P-mass
    left out is one extra outcome that Q never produces (infinite loss: pessimistic).
    """
    r = 2.0 / (math.exp(eps0) + 1.0)
    q = 1.0 / (1.0 + math.exp(-eps0))
    upper: dict[object, float] = {}
    lower: dict[object, float] = {}
    kept = 0.0
    for c in _window(n - 1, r, sigmas):
        log_c = float(stats.binom.logpmf(c, n - 1, r))
        xs = np.arange(_window(c + 1, 0.5, sigmas).start, _window(c + 1, 0.5, sigmas).stop)
        here = stats.binom.pmf(xs, c, 0.5)
        below = stats.binom.pmf(xs - 1, c, 0.5)
        p_x = q * here + (1.0 - q) * below
        q_x = (1.0 - q) * here + q * below
        for x, pv, qv in zip(xs.tolist(), p_x.tolist(), q_x.tolist(), strict=True):
            if pv > 0.0 and qv > 0.0:
                upper[(x, c)] = log_c + math.log(pv)
                lower[(x, c)] = log_c + math.log(qv)
                kept += math.exp(upper[(x, c)])
    upper["rest"] = math.log(max(1.0 - kept, 1e-300))
    return lower, upper


def direct_blanket_lifetime(
    n: int, eps0: float, epochs: int, delta: float, interval: float = 1e-4
) -> float:
    """Lifetime ε of binary RR at crowd n, composed ``epochs`` times by dp_accounting."""
    lower, upper = blanket_pair_log_pmfs(n, eps0)
    single = pld.from_two_probability_mass_functions(
        lower, upper, pessimistic_estimate=True, value_discretization_interval=interval
    )
    return float(single.self_compose(epochs).get_epsilon_for_delta(delta))


def lower_2rr_lifetime(
    n: int, eps0: float, epochs: int, delta: float, interval: float = 1e-4
) -> float:
    """FMT21 Appendix F pair composed ``epochs`` times, optimistic: a lower bound.

    ``c0 ~ Bin(n, p)`` vs ``c1 ~ Bin(n - 1, p) + Bern(1 - p)``, ``p = 1/(e^ε0 + 1)``: the
    shuffled binary RR reports of (0, ..., 0) and (1, 0, ..., 0), the same user every epoch.
    """
    p = 1.0 / (math.exp(eps0) + 1.0)
    support = np.arange(0, n + 1)
    log0 = stats.binom.logpmf(support, n, p)
    pmf1 = p * stats.binom.pmf(support, n - 1, p) + (1.0 - p) * stats.binom.pmf(
        support - 1, n - 1, p
    )
    keep = (log0 > -200.0) & (pmf1 > 1e-200)
    zero = {int(c): float(v) for c, v in zip(support[keep], log0[keep], strict=True)}
    one = {int(c): math.log(v) for c, v in zip(support[keep], pmf1[keep], strict=True)}
    single = pld.from_two_probability_mass_functions(
        zero,
        one,
        pessimistic_estimate=False,
        value_discretization_interval=interval,
        symmetric=False,
    )
    return float(single.self_compose(epochs).get_epsilon_for_delta(delta))
