"""Paper-scale experiments behind ``esa simulate`` (ESA-revisited §VII).

For every target central ε_c: plan ε0 with the paper's bound (``cheu-lemma-ii6``) and/or our
tightest valid bound, sample the channel's accumulator with the mechanism's vectorized
``simulate_aggregate``, estimate, and compare the RMSE against the truth with the RMSE the
estimator's variance predicts. τ = 1 rows are k-RAPPOR with attribute fragments; τ > 1 rows are
report fragments with a backstop at the planned ε_b (ESA-revisited Theorem IV.2) and, unless the
caller fixes it, the ε_f whose fragment noise adds as much variance as the backstop
(``sinh(ε_f/2) = sinh(ε_b/2)/sqrt(τ)``). Results and that choice: docs/reproduction.md.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from common.accounting import (
    BinaryRR,
    BinaryRRSequence,
    LocalRandomizer,
    certify,
    fragment_eps,
    plan_eps0,
)
from common.accounting.shuffle_bounds import CHEU_LEMMA_II6
from common.mechanisms import BoundMechanism, krappor, longitudinal, rfrag
from common.mechanisms.longitudinal import LongitudinalParams
from services.tools.populations import HistogramPopulation, LongitudinalPopulation

FloatArray = npt.NDArray[np.float64]
COLUMNS = (
    "dataset",
    "n",
    "k",
    "eps_c",
    "delta",
    "bound",
    "tau",
    "eps0",
    "eps_l_inf",
    "eps_l1",
    "rmse",
    "rmse_predicted",
)
BOUNDS = {"paper": CHEU_LEMMA_II6, "tightest": None}


@dataclass(frozen=True)
class ResultRow:
    """One line of ``results.csv``."""

    dataset: str
    n: int
    k: int
    eps_c: float
    delta: float
    bound: str
    tau: int
    eps0: float
    eps_l_inf: float
    eps_l1: float
    rmse: float
    rmse_predicted: float


@dataclass(frozen=True)
class HistogramRun:
    """A result row plus the estimate it came from (for figures)."""

    row: ResultRow
    estimate: FloatArray
    std_error: FloatArray


@dataclass(frozen=True)
class LongitudinalRun:
    """A result row plus the series it came from (for figures)."""

    row: ResultRow
    truth: FloatArray
    estimate: FloatArray
    std_error: FloatArray
    certified_eps: float


def balanced_fragment_eps(eps_b: float, tau: int) -> float:
    """ε_f whose fragment noise equals the backstop's: ``sinh(ε_f/2) = sinh(ε_b/2)/sqrt(τ)``."""
    return 2.0 * math.asinh(math.sinh(eps_b / 2.0) / math.sqrt(tau))


def _plan(
    eps_c: float, delta: float, n: int, bound: str, randomizer: LocalRandomizer | None = None
) -> float:
    return plan_eps0(eps_c, delta, n, randomizer or BinaryRR(), bound=BOUNDS[bound]).eps0


def _rmse(estimate: FloatArray, truth: npt.NDArray[np.int64] | FloatArray) -> float:
    return float(np.sqrt(np.mean((estimate - truth) ** 2)))


def histogram_tasks(
    eps_cs: Sequence[float], bounds: Sequence[str], taus: Sequence[int]
) -> list[tuple[float, str, int]]:
    """Every (ε_c, bound, τ) combination, in output order."""
    return [(e, b, t) for e in eps_cs for b in bounds for t in taus]


def run_histogram(
    population: HistogramPopulation,
    tasks: Sequence[tuple[float, str, int]],
    delta: float,
    seed: int,
    eps_f: float | None = None,
    on_done: Callable[[], None] | None = None,
) -> Iterator[HistogramRun]:
    """Plan, simulate and score each task; yields as it goes (for a progress bar)."""
    gen = np.random.default_rng(seed)
    n, k = population.n, population.k
    for eps_c, bound, tau in tasks:
        eps0 = _plan(eps_c, delta, n, bound)
        if tau == 1:
            params = krappor.KRapporParams(k=k, eps=eps0)
            attributes = BoundMechanism(mechanism=krappor.KRappor(), params=params)
            aggregate = krappor.simulate_aggregate(population.counts, params, gen)
            estimate = attributes.estimate(aggregate)
            predicted = math.sqrt(krappor.variance(n, params))
            l_inf = l_one = eps0
        else:
            fragment = eps_f if eps_f is not None else balanced_fragment_eps(eps0, tau)
            r_params = rfrag.RFragParams(k=k, eps_b=eps0, eps_f=fragment, tau=tau)
            accumulator = rfrag.simulate_aggregate(population.counts, r_params, gen)
            fragments = BoundMechanism(mechanism=rfrag.RFrag(), params=r_params)
            estimate = fragments.estimate(accumulator)
            predicted = math.sqrt(rfrag.variance(n, r_params))
            l_inf, l_one = fragment_eps(eps0, fragment, tau), fragment_eps(eps0, fragment, 1)
        row = ResultRow(
            dataset=population.name,
            n=n,
            k=k,
            eps_c=eps_c,
            delta=delta,
            bound=bound,
            tau=tau,
            eps0=eps0,
            eps_l_inf=l_inf,
            eps_l1=l_one,
            rmse=_rmse(estimate.values, population.counts),
            rmse_predicted=predicted,
        )
        if on_done is not None:
            on_done()
        yield HistogramRun(row, estimate.values, estimate.std_errors)


def planning_crowd(n: int, levels: int) -> int:
    """A per-(period, level) crowd the actual one falls below with negligible probability.

    Levels are uniform, so a level holds Bin(n, 1/L) users; we plan with 4 standard deviations
    below the mean. The certificate printed afterwards uses the crowd actually observed.
    """
    mean = n / levels
    return max(1, math.floor(mean - 4.0 * math.sqrt(mean * (1 - 1 / levels))))


def run_longitudinal(
    population: LongitudinalPopulation,
    eps_cs: Sequence[float],
    bounds: Sequence[str],
    delta: float,
    seed: int,
    on_done: Callable[[], None] | None = None,
    repeats: int = 10,
) -> Iterator[LongitudinalRun]:
    """Plan the sequence ε per target, simulate the tree, score the running counts.

    Periods share tree nodes, so one run's errors are strongly correlated across t; the RMSE is
    averaged (as mean squared error) over ``repeats`` independent simulations. The figure
    shows the first.
    """
    gen = np.random.default_rng(seed)
    changes = population.changes
    levels = changes.d.bit_length()
    crowd = planning_crowd(changes.n_users, levels)
    truth = changes.true_counts().astype(np.float64)
    for eps_c in eps_cs:
        for bound in bounds:
            eps = _plan(eps_c, delta, crowd, bound, BinaryRRSequence())
            params = LongitudinalParams(d=changes.d, k=population.k, eps=eps)
            accumulator = longitudinal.simulate_aggregate(changes, params, gen)
            estimate = _tree(params).estimate(accumulator)
            squared = [float(np.mean((estimate.values - truth) ** 2))]
            squared += _repeated_errors(changes, params, truth, gen, repeats - 1)
            first_nodes = longitudinal.TreeAccumulator.offsets(changes.d)[:-1]
            observed = int(accumulator.reports[first_nodes].min())
            method = BOUNDS[bound]
            methods = None if method is None else [method]
            certified = certify(BinaryRRSequence(), eps, observed, delta, methods).certified.eps
            row = ResultRow(
                dataset="longitudinal",
                n=changes.n_users,
                k=population.k,
                eps_c=eps_c,
                delta=delta,
                bound=bound,
                tau=1,
                eps0=eps,
                eps_l_inf=eps,
                eps_l1=eps / 2.0,
                rmse=math.sqrt(float(np.mean(squared))),
                rmse_predicted=float(np.sqrt(np.mean(estimate.std_errors**2))),
            )
            if on_done is not None:
                on_done()
            yield LongitudinalRun(
                row=row,
                truth=truth,
                estimate=estimate.values,
                std_error=estimate.std_errors,
                certified_eps=certified,
            )


def _tree(
    params: LongitudinalParams,
) -> BoundMechanism[LongitudinalParams, longitudinal.TreeAccumulator]:
    """The longitudinal mechanism with ``params`` bound."""
    return BoundMechanism(mechanism=longitudinal.Longitudinal(), params=params)


def _repeated_errors(
    changes: longitudinal.ChangeLog,
    params: LongitudinalParams,
    truth: FloatArray,
    gen: np.random.Generator,
    repeats: int,
) -> list[float]:
    """Mean squared errors of ``repeats`` more independent simulations of the tree."""
    errors = []
    for _ in range(repeats):
        again = _tree(params).estimate(longitudinal.simulate_aggregate(changes, params, gen))
        errors.append(float(np.mean((again.values - truth) ** 2)))
    return errors


def write_results(rows: Sequence[ResultRow], path: Path) -> None:
    """``results.csv`` with the columns of the issue, in order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))
