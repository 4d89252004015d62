"""Tree-based longitudinal reports — Erlingsson et al. 2019, Algorithms 1–2 (docs/mechanisms.md).

A user's 0/1 state over periods ``t = 1..d`` changes at most k times; the client keeps
``(κ*, h*, κ, c)`` and, at EVERY t divisible by ``2^{h*-1}`` (report timing must not depend on
the data, Theorem 5), reports ``(h*, t, u)``: (ε/2)-RR of its κ*-th change, or uniform ±1.
Wire payload (code 3): ``uint8 level h | uint32 period t | int8 u``. The server sums the
dyadic cover of [1, t] scaled by ``c_ε k L`` with ``L = log2(d) + 1`` levels (the paper's
log2 d would bias it). The sequence is ε-LDP (Theorem 5); central argument:
:class:`common.accounting.BinaryRRSequence`. The device facet (parameters, the client's state
and its reports) is :mod:`common.mechanisms.device.longitudinal`.

Algorithm, estimator and variance: docs/mechanisms.md, "Tree-based longitudinal reports".
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from common.accounting import BinaryRRSequence
from common.mechanisms._estimates import Estimate, FloatArray, IntArray
from common.mechanisms._wire import FragmentError, unframe
from common.mechanisms.base import (
    Mechanism,
    NoDataError,
    PrivacyDescription,
    Received,
    ReleaseCertificate,
)
from common.mechanisms.device import BatchContext
from common.mechanisms.device.longitudinal import (
    MAX_HORIZON,
    MECHANISM_CODE,
    NAME,
    PAYLOAD_SIZE,
    REPORT,
    LongitudinalDevice,
    LongitudinalParams,
    TreeState,
    setup,
    update,
)

__all__ = [
    "MAX_HORIZON",
    "MECHANISM_CODE",
    "NAME",
    "PAYLOAD_SIZE",
    "REPORT",
    "ChangeLog",
    "Longitudinal",
    "LongitudinalDevice",
    "LongitudinalParams",
    "TreeAccumulator",
    "TreeState",
    "cover_matrix",
    "dyadic_cover",
    "parse",
    "setup",
    "simulate_aggregate",
    "smallest_level_crowd",
    "update",
]


def parse(fragment: bytes, params: LongitudinalParams) -> tuple[int, int, int]:
    """``(h, t, u)`` of one report.

    Raises:
        FragmentError: if it does not parse, or (h, t, u) is not a valid report.
    """
    h, t, u = REPORT.unpack(unframe(MECHANISM_CODE, PAYLOAD_SIZE, fragment))
    if (
        not 1 <= h <= params.levels
        or not 1 <= t <= params.d
        or t % (1 << (h - 1))
        or u not in (-1, 1)
    ):
        raise FragmentError(f"invalid longitudinal report (h={h}, t={t}, u={u})")
    return h, t, u


@dataclass
class TreeAccumulator:
    """``T[h, i]`` sums and ``N[h, i]`` report counts, flattened level by level."""

    params_d: int
    sums: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    reports: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @staticmethod
    def offsets(d: int) -> IntArray:
        """Start of each level's nodes in the flat arrays (index h-1), plus the total."""
        sizes = [d >> (h - 1) for h in range(1, d.bit_length() + 1)]
        result: IntArray = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return result

    @classmethod
    def empty(cls, d: int) -> TreeAccumulator:
        """An empty tree for horizon ``d``."""
        size = int(cls.offsets(d)[-1])
        return cls(d, np.zeros(size, np.int64), np.zeros(size, np.int64))

    def flat_index(self, h: IntArray, t: IntArray) -> IntArray:
        """Flat position of node ``[h, t / 2^{h-1}]``."""
        result: IntArray = self.offsets(self.params_d)[h - 1] + (t >> (h - 1)) - 1
        return result

    def merge(self, other: TreeAccumulator) -> TreeAccumulator:
        """Sum of two accumulators over the same horizon."""
        if other.params_d != self.params_d:
            raise ValueError(f"cannot merge horizons d={self.params_d} and d={other.params_d}")
        return TreeAccumulator(self.params_d, self.sums + other.sums, self.reports + other.reports)

    def to_bytes(self) -> bytes:
        """Compressed, pickle-free serialization."""
        buffer = io.BytesIO()
        np.savez_compressed(
            buffer, d=np.array([self.params_d]), sums=self.sums, reports=self.reports
        )
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> TreeAccumulator:
        """Inverse of :meth:`to_bytes`."""
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return cls(
                int(arrays["d"][0]),
                arrays["sums"].astype(np.int64),
                arrays["reports"].astype(np.int64),
            )

    @property
    def n(self) -> int:
        """Users seen: every user reports at its level's first node."""
        starts = self.offsets(self.params_d)[:-1]
        return int(self.reports[starts].sum())


def dyadic_cover(t: int, d: int) -> list[tuple[int, int]]:
    """Nodes ``[h, i]`` whose intervals ``((i-1) 2^{h-1}, i 2^{h-1}]`` partition [1, t]."""
    nodes: list[tuple[int, int]] = []
    covered = 0
    for bit in range(d.bit_length() - 1, -1, -1):
        if t & (1 << bit):
            covered += 1 << bit
            nodes.append((bit + 1, covered >> bit))
    return nodes


def cover_matrix(params: LongitudinalParams) -> tuple[IntArray, IntArray]:
    """For every t, the flat node indices of C(t): (row t-1, flat index) pairs."""
    offsets = TreeAccumulator.offsets(params.d)
    rows: list[int] = []
    cols: list[int] = []
    for t in range(1, params.d + 1):
        for h, i in dyadic_cover(t, params.d):
            rows.append(t - 1)
            cols.append(int(offsets[h - 1]) + i - 1)
    return np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)


@dataclass(frozen=True)
class ChangeLog:
    """A longitudinal population: every change as (user, period, sign), plus the user count."""

    n_users: int
    d: int
    user: IntArray
    period: IntArray
    sign: IntArray

    def true_counts(self) -> IntArray:
        """``Σ_i st_i[t]`` for t = 1..d (states start at 0)."""
        per_period = np.zeros(self.d + 1, dtype=np.int64)
        np.add.at(per_period, self.period, self.sign)
        result: IntArray = np.cumsum(per_period)[1:]
        return result


def simulate_aggregate(
    population: ChangeLog, params: LongitudinalParams, rng: np.random.Generator
) -> TreeAccumulator:
    """Sample ``T`` and ``N`` directly: levels and κ* per user, binomials per node."""
    if population.d != params.d:
        raise ValueError(f"population horizon d={population.d} differs from params d={params.d}")
    n = population.n_users
    level = rng.integers(1, params.levels + 1, size=n)
    kappa_star = rng.integers(1, params.k + 1, size=n)
    order = np.lexsort((population.period, population.user))
    user, period, sign = population.user[order], population.period[order], population.sign[order]
    first = np.r_[True, user[1:] != user[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(user.size), 0))
    rank = np.arange(user.size) - group_start + 1
    chosen = rank == kappa_star[user]
    acc = TreeAccumulator.empty(params.d)
    h_users = level[user[chosen]]
    node_t = (((period[chosen] - 1) >> (h_users - 1)) + 1) << (h_users - 1)
    flat = acc.flat_index(h_users, node_t)
    plus = np.zeros_like(acc.sums)
    minus = np.zeros_like(acc.sums)
    np.add.at(plus, flat[sign[chosen] > 0], 1)
    np.add.at(minus, flat[sign[chosen] < 0], 1)
    offsets = TreeAccumulator.offsets(params.d)
    per_level = np.bincount(level, minlength=params.levels + 1)[1:]
    acc.reports = np.repeat(per_level, np.diff(offsets)).astype(np.int64)
    rest = acc.reports - plus - minus
    q = params.keep_prob
    acc.sums = (2 * rng.binomial(plus, q) - plus) - (2 * rng.binomial(minus, q) - minus)
    acc.sums += 2 * rng.binomial(rest, 0.5) - rest
    return acc


def smallest_level_crowd(accumulator: TreeAccumulator) -> int:
    """Smallest number of reports shuffled together at one tree node in a batch.

    A batch holds the reports of the periods its epoch saw; a report of period t at level h
    lands in the node ending at t (Algorithm 1). The period is read from the reports, never
    from the epoch number (epochs are ``unix time // epoch_seconds``). The smallest non-empty
    node is the crowd the amplification bound may count on.
    """
    filled = accumulator.reports[accumulator.reports > 0]
    return int(filled.min()) if filled.size else 0


class Longitudinal(LongitudinalDevice, Mechanism[LongitudinalParams, TreeAccumulator]):
    """Tree-based longitudinal reports through the mechanism interface."""

    randomizer_type = BinaryRRSequence

    def new_accumulator(self, params: LongitudinalParams) -> TreeAccumulator:
        return TreeAccumulator.empty(params.d)

    def load_accumulator(self, params: LongitudinalParams, data: bytes) -> TreeAccumulator:
        return TreeAccumulator.from_bytes(data)

    def accumulate(
        self,
        params: LongitudinalParams,
        accumulator: TreeAccumulator,
        fragments: Sequence[bytes],
        n_contributions: int,
        batch: BatchContext,
    ) -> int:
        """Add one batch of reports (Algorithm 2, line 4); returns how many were invalid."""
        parsed: list[tuple[int, int, int]] = []
        invalid = 0
        for fragment in fragments:
            try:
                parsed.append(parse(fragment, params))
            except (FragmentError, struct.error):
                invalid += 1
        if parsed:
            h, t, u = (np.asarray(column, dtype=np.int64) for column in zip(*parsed, strict=True))
            flat = accumulator.flat_index(h, t)
            np.add.at(accumulator.sums, flat, u)
            np.add.at(accumulator.reports, flat, 1)
        return invalid

    def estimate(self, params: LongitudinalParams, accumulator: TreeAccumulator) -> Estimate:
        """``f̃_t`` for t = 1..d with standard errors (Algorithm 2, scaled by L)."""
        rows, cols = cover_matrix(params)
        scale = params.c_eps * params.k * params.levels
        sums = np.zeros(params.d)
        np.add.at(sums, rows, accumulator.sums[cols])
        reports = np.zeros(params.d)
        np.add.at(reports, rows, accumulator.reports[cols])
        values: FloatArray = scale * sums
        std: FloatArray = scale * np.sqrt(reports)
        return Estimate(
            values=values,
            std_errors=std,
            n=accumulator.n,
            clipped=False,
            note="Algorithm 2 scaled by L = log2 d + 1",
        )

    def certify(
        self,
        params: LongitudinalParams,
        delta: float,
        received: Sequence[Received[TreeAccumulator]],
    ) -> ReleaseCertificate:
        """A report hides among the reports of its level in its period and batch; only one
        report per user carries data, so a range is certified at the smallest such crowd in
        it, with no composition over periods (docs/mechanisms.md)."""
        crowds = {
            f"{item.epoch}/{item.shuffler_id}": smallest_level_crowd(item.accumulator)
            for item in received
        }
        crowds = {key: n for key, n in crowds.items() if n > 0}
        if not crowds:
            raise NoDataError("no report in any tree node yet")
        cert = self.privacy(params).certify(min(crowds.values()), delta)
        periods = len({item.epoch for item in received})
        return ReleaseCertificate(
            certified=cert.certified,
            other=cert.other_notion,
            lower=cert.lower,
            crowds=crowds,
            epochs=periods,
        )

    def privacy(self, params: LongitudinalParams) -> PrivacyDescription:
        """Binary RR at ε/2 per report (Theorem 5), removal, at the sequence ε."""
        return PrivacyDescription(BinaryRRSequence(), params.eps)
