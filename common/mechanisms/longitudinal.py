"""Tree-based longitudinal reports — Erlingsson et al. 2019, Algorithms 1 and 2 (MECHANISMS.md §3).

A user's 0/1 state over periods ``t = 1..d`` changes at most k times; the client keeps
``(κ*, h*, κ, c)`` and, at EVERY t divisible by ``2^{h*-1}`` (report timing must not depend on
the data, Theorem 5), reports ``(h*, t, u)``: (ε/2)-RR of its κ*-th change, or uniform ±1.
Wire payload (code 3): ``uint8 level h | uint32 period t | int8 u``. The server sums the
dyadic cover of [1, t] scaled by ``c_ε k L`` with ``L = log2(d) + 1`` levels (the paper's
log2 d would bias it). The sequence is ε-LDP (Theorem 5); central argument:
:class:`common.accounting.BinaryRRSequence`.

Algorithm, estimator and variance: docs/mechanisms.md, "Tree-based longitudinal reports".
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.accounting import BinaryRRSequence
from common.mechanisms._estimates import Estimate, FloatArray, IntArray
from common.mechanisms._histogram import check_eps
from common.mechanisms._wire import FragmentError, frame, unframe
from common.mechanisms.base import (
    BatchContext,
    DeviceState,
    Encoded,
    FragmentCount,
    LocalPrivacy,
    Mechanism,
    MechanismError,
    NoDataError,
    PrivacyDescription,
    Received,
    ReleaseCertificate,
    StaleUpdateError,
    StateUpdate,
    ValueKind,
)
from common.randomness import RandomSource, bernoulli, default_source

NAME = "longitudinal"
MECHANISM_CODE = 3
PAYLOAD_SIZE = 6
_PAYLOAD = struct.Struct(">BIb")
MAX_HORIZON = 1 << 20


@dataclass(frozen=True, slots=True)
class LongitudinalParams:
    """Attributes: ``d`` horizon (power of two), ``k`` max changes per user, ``eps`` sequence ε."""

    d: int
    k: int
    eps: float

    def __post_init__(self) -> None:
        d_ok = (
            isinstance(self.d, int) and not isinstance(self.d, bool) and 1 <= self.d <= MAX_HORIZON
        )
        if not d_ok or self.d & (self.d - 1):
            raise ValueError(f"d must be a power of two in [1, {MAX_HORIZON}], got d={self.d!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got k={self.k!r}")
        check_eps("eps", self.eps)

    @property
    def levels(self) -> int:
        """``L = log2(d) + 1``."""
        return self.d.bit_length()

    @property
    def c_eps(self) -> float:
        """``c_ε = (e^{ε/2} + 1)/(e^{ε/2} - 1)``."""
        return 1.0 / math.tanh(self.eps / 4.0)

    @property
    def keep_prob(self) -> float:
        """Probability that a data report keeps the sign of c: ``e^{ε/2}/(1 + e^{ε/2})``."""
        return 1.0 / (1.0 + math.exp(-self.eps / 2.0))

    def nodes(self, level: int) -> int:
        """``H(h) = d / 2^{h-1}`` nodes at level h."""
        return self.d >> (level - 1)


@dataclass(frozen=True, slots=True)
class TreeState:
    """The client's four integers (Algorithm 1): κ*, h*, changes seen κ, pending c ∈ {-1,0,1}."""

    kappa_star: int
    h_star: int
    kappa: int = 0
    c: int = 0


def setup(params: LongitudinalParams, rng: RandomSource | None = None) -> TreeState:
    """SETUP(d, k): ``κ* ~ U[k]``, ``h* ~ U[L]``."""
    rng = rng or default_source()
    return TreeState(1 + rng.randbelow(params.k), 1 + rng.randbelow(params.levels))


def update(
    state: TreeState, t: int, x_t: int, params: LongitudinalParams, rng: RandomSource | None = None
) -> tuple[TreeState, bytes | None]:
    """UPDATE(t, x_t): the new state and the report for period t, if this is a reporting time.

    Raises:
        ValueError: if t is not in [1, d] or x_t not in {-1, 0, 1}.
    """
    if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= params.d:
        raise ValueError(f"t must be an integer in [1, {params.d}], got t={t!r}")
    if x_t not in (-1, 0, 1) or isinstance(x_t, bool):
        raise ValueError(f"x_t must be -1, 0 or 1, got x_t={x_t!r}")
    rng = rng or default_source()
    kappa, c = state.kappa, state.c
    if x_t != 0:
        kappa += 1
        if kappa == state.kappa_star:
            c = x_t
    if t % (1 << (state.h_star - 1)):
        return TreeState(state.kappa_star, state.h_star, kappa, c), None
    if c == 0:
        u = 1 if bernoulli(rng, 0.5) else -1
    else:
        u = c if bernoulli(rng, params.keep_prob) else -c
    report = frame(MECHANISM_CODE, _PAYLOAD.pack(state.h_star, t, u))
    return TreeState(state.kappa_star, state.h_star, kappa, 0), report


def parse(fragment: bytes, params: LongitudinalParams) -> tuple[int, int, int]:
    """``(h, t, u)`` of one report.

    Raises:
        FragmentError: if it does not parse, or (h, t, u) is not a valid report.
    """
    h, t, u = _PAYLOAD.unpack(unframe(MECHANISM_CODE, PAYLOAD_SIZE, fragment))
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


class Longitudinal(Mechanism[LongitudinalParams, TreeAccumulator]):
    """Tree-based longitudinal reports through the mechanism interface.

    The device state is Algorithm 1's four integers plus the current 0/1 state and the last
    period given; a period that is not a reporting time of the device's level sends nothing.
    """

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE
    randomizer_type = BinaryRRSequence
    value_kind = ValueKind.STATE

    def parse_params(self, raw: Mapping[str, Any]) -> LongitudinalParams:
        return LongitudinalParams(**raw)

    def fragment_count(self, params: LongitudinalParams, batch: BatchContext) -> FragmentCount:
        """A contribution is one report (h*, t, u), sent only in periods its level reports."""
        return FragmentCount.exactly(1)

    def domain_size(self, params: LongitudinalParams) -> int:
        return params.d

    def new_state(self, params: LongitudinalParams, rng: RandomSource) -> DeviceState:
        tree = setup(params, rng)
        return {"tree": [tree.kappa_star, tree.h_star, tree.kappa, tree.c], "st": 0, "last": 0}

    def encode(
        self,
        params: LongitudinalParams,
        value: Any,
        state: DeviceState | None,
        rng: RandomSource,
        shufflers: int,
    ) -> Encoded:
        if not isinstance(value, StateUpdate):
            raise MechanismError(f"a longitudinal report takes a StateUpdate, got {value!r}")
        saved = state or self.new_state(params, rng)
        if value.period <= saved["last"]:
            raise StaleUpdateError(
                f"period {value.period} is not after the last period {saved['last']}"
            )
        step = 0 if not value.changed else (1 if saved["st"] == 0 else -1)
        try:
            tree, report = update(TreeState(*saved["tree"]), value.period, step, params, rng)
        except ValueError as error:
            raise MechanismError(str(error)) from error
        new = {
            "tree": [tree.kappa_star, tree.h_star, tree.kappa, tree.c],
            "st": saved["st"] ^ int(value.changed),
            "last": value.period,
        }
        return Encoded(() if report is None else ((None, (report,)),), new)

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

    def local_privacy(self, params: LongitudinalParams) -> LocalPrivacy:
        """Theorem 5: the sequence is ε-LDP; a single report is (ε/2)-DP."""
        half = params.eps / 2.0
        return LocalPrivacy(
            removal=half,
            replacement=params.eps,
            eps_l_inf=params.eps,
            eps_l1=half,
            note="sequence ε (Theorem 5); report ε/2",
        )

    def certify(
        self,
        params: LongitudinalParams,
        delta: float,
        received: Sequence[Received[TreeAccumulator]],
    ) -> ReleaseCertificate:
        """A report hides among the reports of its level in its period and batch; only one
        report per user carries data, so a range is certified at the smallest such crowd in
        it, with no composition over periods (MECHANISMS.md §3)."""
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
