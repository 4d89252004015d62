"""Tree-based longitudinal reports, the device facet — Erlingsson et al. 2019, Algorithm 1.

A user's 0/1 state over periods ``t = 1..d`` changes at most k times; the client keeps
``(κ*, h*, κ, c)`` and, at EVERY t divisible by ``2^{h*-1}`` (report timing must not depend on
the data, Theorem 5), reports ``(h*, t, u)``: (ε/2)-RR of its κ*-th change, or uniform ±1.
Wire payload (code 3): ``uint8 level h | uint32 period t | int8 u``. The sequence is ε-LDP
(Theorem 5). The server's tree and estimate: :mod:`common.mechanisms.longitudinal`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.mechanisms._wire import frame
from common.mechanisms.device import (
    BatchContext,
    DeviceMechanism,
    DeviceState,
    Encoded,
    FragmentCount,
    LocalPrivacy,
    MechanismError,
    StaleUpdateError,
    StateUpdate,
    ValueKind,
)
from common.mechanisms.device._histogram import check_eps
from common.randomness import RandomSource, bernoulli, default_source

NAME = "longitudinal"
MECHANISM_CODE = 3
PAYLOAD_SIZE = 6
#: A report's payload: level h, period t, sign u.
REPORT = struct.Struct(">BIb")
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
    report = frame(MECHANISM_CODE, REPORT.pack(state.h_star, t, u))
    return TreeState(state.kappa_star, state.h_star, kappa, 0), report


class LongitudinalDevice(DeviceMechanism[LongitudinalParams]):
    """Tree-based longitudinal reports as a device runs them.

    The device state is Algorithm 1's four integers plus the current 0/1 state and the last
    period given; a period that is not a reporting time of the device's level sends nothing.
    """

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE
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
