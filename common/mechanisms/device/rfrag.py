"""Report fragments with a privacy backstop, the device facet — ESA-revisited Algorithm 2, §IV.

Each one-hot bit gets a backstop ``x' = R_b(x; ε_b)`` drawn ONCE per (device, channel, true
value) and persisted (:class:`BackstopState`); every report sends ``τ`` fresh fragments
``R_f(x'; ε_f)``, row r routed to shuffler ``r mod K``. Wire payload (code 2): ``uint16
fragment index | uint32 bit index``. Local privacy is ``ε(t)`` of Theorem IV.1, capped at
ε_ℓ∞ = ε(τ) only while the backstop is kept: a lost or mismatched state is an error, never a
silent redraw. Estimator and central privacy: :mod:`common.mechanisms.rfrag`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
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
    StateConflictError,
)
from common.mechanisms.device._histogram import check_bins, check_eps, check_value
from common.mechanisms.device._random import geometric_positions, randomized_onehot
from common.randomness import RandomSource, bernoulli

NAME = "rfrag"
MECHANISM_CODE = 2
PAYLOAD_SIZE = 6
MAX_TAU = 1 << 16


class BackstopStateError(StateConflictError):
    """The backstop state is corrupted or was drawn for other parameters."""


@dataclass(frozen=True, slots=True)
class RFragParams:
    """Attributes: ``k`` domain, ``eps_b`` backstop ε, ``eps_f`` fragment ε, ``tau`` rows."""

    k: int
    eps_b: float
    eps_f: float
    tau: int

    def __post_init__(self) -> None:
        check_bins("k", self.k)
        check_eps("eps_b", self.eps_b)
        check_eps("eps_f", self.eps_f)
        if (
            isinstance(self.tau, bool)
            or not isinstance(self.tau, int)
            or not 1 <= self.tau < MAX_TAU
        ):
            raise ValueError(f"tau must be an integer in [1, {MAX_TAU}), got tau={self.tau!r}")

    @property
    def backstop_flip(self) -> float:
        """``p_b = 1/(1 + e^{ε_b})``."""
        return 1.0 / (1.0 + math.exp(self.eps_b))

    @property
    def fragment_flip(self) -> float:
        """``p_f = 1/(1 + e^{ε_f})``."""
        return 1.0 / (1.0 + math.exp(self.eps_f))

    def fingerprint(self) -> str:
        """Identifies the parameters a backstop was drawn for (k and ε_b)."""
        return f"rfrag/k={self.k}/eps_b={self.eps_b!r}"


@dataclass
class BackstopState:
    """Permanent randomized responses of one device on one channel, memoized per true value.

    ``backstops[value]`` is the sorted list of 1-bits of ``R_b(onehot(value))``. ``state_id`` is
    random per device state, so a lost state shows up as a new identity.
    """

    fingerprint: str
    backstops: dict[int, list[int]] = field(default_factory=dict)
    state_id: str = field(default_factory=lambda: secrets.token_hex(16))

    def backstop(self, value: int, params: RFragParams, rng: RandomSource) -> list[int]:
        """The backstop for ``value``, drawn on first use and reused forever after."""
        if self.fingerprint != params.fingerprint():
            raise BackstopStateError(
                f"backstops were drawn for {self.fingerprint}, not {params.fingerprint()}; "
                "redrawing would void the ε_ℓ∞ cap: treat this as a new device"
            )
        if value not in self.backstops:
            self.backstops[value] = randomized_onehot(rng, value, params.k, params.backstop_flip)
        return self.backstops[value]

    def to_json(self) -> str:
        """Serialization with a SHA-256 checksum, so corruption is detected on load."""
        body = {
            "fingerprint": self.fingerprint,
            "state_id": self.state_id,
            "backstops": {str(v): ones for v, ones in sorted(self.backstops.items())},
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({"body": body, "sha256": hashlib.sha256(text.encode()).hexdigest()})

    @classmethod
    def from_json(cls, data: str) -> BackstopState:
        """Inverse of :meth:`to_json`.

        Raises:
            BackstopStateError: if the data does not parse or the checksum does not match.
        """
        try:
            outer = json.loads(data)
            body = outer["body"]
            text = json.dumps(body, sort_keys=True, separators=(",", ":"))
            if hashlib.sha256(text.encode()).hexdigest() != outer["sha256"]:
                raise BackstopStateError("backstop state checksum mismatch: the state is corrupted")
            backstops = {int(v): [int(i) for i in ones] for v, ones in body["backstops"].items()}
            return cls(str(body["fingerprint"]), backstops, str(body["state_id"]))
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, BackstopStateError):
                raise
            raise BackstopStateError(f"backstop state does not parse: {error}") from error


def new_state(params: RFragParams) -> BackstopState:
    """A fresh (empty) backstop state for a new device."""
    return BackstopState(params.fingerprint())


def _complement_positions(ones: Sequence[int], ranks: Iterable[int]) -> list[int]:
    """Map ranks among the zeros of a sparse 0/1 vector to positions (``ones`` sorted): the
    rank-r zero is preceded by the ones ``i`` with ``ones[i] - i <= r``."""
    shifted = [one - i for i, one in enumerate(ones)]
    return [rank + bisect.bisect_right(shifted, rank) for rank in ranks]


def _row(r: int, ones: list[int], params: RFragParams, rng: RandomSource) -> list[bytes]:
    p = params.fragment_flip
    kept = [i for i in ones if not bernoulli(rng, p)]
    flipped = _complement_positions(ones, geometric_positions(rng, params.k - len(ones), p))
    prefix = r.to_bytes(2, "big")
    return [frame(MECHANISM_CODE, prefix + i.to_bytes(4, "big")) for i in sorted(kept + flipped)]


def rows_of(params: RFragParams, batch: BatchContext) -> list[int]:
    """Rows routed to a shuffler: r with ``r mod K`` its index (ESA-revisited §IV)."""
    return [r for r in range(params.tau) if r % batch.shuffler_count == batch.shuffler_index]


class RFragDevice(DeviceMechanism[RFragParams]):
    """Report fragments with a persistent backstop as a device runs it.

    The device state is the :class:`BackstopState` (it must survive restarts: regenerating it
    would void the ε_ℓ∞ cap); row r of a report goes to shuffler ``r mod K``.
    """

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE

    def parse_params(self, raw: Mapping[str, Any]) -> RFragParams:
        return RFragParams(**raw)

    def domain_size(self, params: RFragParams) -> int:
        return params.k

    def fragment_limit(self, params: RFragParams) -> int:
        return params.k * params.tau

    def fragment_count(self, params: RFragParams, batch: BatchContext) -> FragmentCount:
        """The 1-bits of the R rows routed to this shuffler. Bit j of a row is 1 w.p.
        q = 1 - p_f if the backstop bit is set, else p_f; the backstop bit is set w.p. 1 - p_b
        for the value, p_b for the k - 1 others, whatever the value. Rows share the backstop,
        so per bit Var = R p_f(1 - p_f) + R² (1 - 2p_f)² π(1 - π), π its set probability."""
        rows = len(rows_of(params, batch))
        pb, pf = params.backstop_flip, params.fragment_flip
        set_value, set_other = 1.0 - pb, pb
        mean = rows * sum(
            share * (pi * (1.0 - pf) + (1.0 - pi) * pf)
            for share, pi in ((1, set_value), (params.k - 1, set_other))
        )
        variance = params.k * (
            rows * pf * (1.0 - pf) + rows * rows * (1.0 - 2.0 * pf) ** 2 * pb * (1.0 - pb)
        )
        # bits of different positions are independent; one position carries <= ``rows``
        return FragmentCount(
            minimum=0, maximum=rows * params.k, mean=mean, variance=variance, piece=rows
        )

    def new_state(self, params: RFragParams, rng: RandomSource) -> DeviceState:
        return {"backstops": new_state(params).to_json()}

    def encode(
        self,
        params: RFragParams,
        value: Any,
        state: DeviceState | None,
        rng: RandomSource,
        shufflers: int,
    ) -> Encoded:
        backstops = BackstopState.from_json(state["backstops"]) if state else new_state(params)
        try:
            rows = self.encode_rows(params, value, backstops, rng)
        except MechanismError:
            raise
        except ValueError as error:
            raise MechanismError(str(error)) from error
        routed: dict[int, list[bytes]] = {}
        for r, row in enumerate(rows):
            routed.setdefault(r % shufflers, []).extend(row)
        routes = tuple((slot, tuple(fragments)) for slot, fragments in sorted(routed.items()))
        return Encoded(routes, {"backstops": backstops.to_json()})

    def local_privacy(self, params: RFragParams) -> LocalPrivacy:
        """Theorem IV.1: removal ε_ℓ∞ = ε(τ), ε_ℓ1 = ε(1); replacement touches two bits: 2 ε(τ)."""
        # The closed form of common.accounting.local (no scipy), loaded by an rfrag
        # channel's first use rather than by the SDK's import.
        from common.accounting.local import fragment_eps

        eps_inf = fragment_eps(params.eps_b, params.eps_f, params.tau)
        eps_one = fragment_eps(params.eps_b, params.eps_f, 1)
        return LocalPrivacy(
            removal=eps_inf,
            replacement=2 * eps_inf,
            eps_l_inf=eps_inf,
            eps_l1=eps_one,
            note="Theorem IV.1",
        )

    def encode_rows(
        self, params: RFragParams, value: int, state: BackstopState, rng: RandomSource
    ) -> list[list[bytes]]:
        """τ rows of fragments for one report; row r goes to shuffler ``r mod K``."""
        value = check_value(value, params.k)
        ones = state.backstop(value, params, rng)
        return [_row(r, ones, params, rng) for r in range(params.tau)]
