"""Report fragments with a privacy backstop — ESA-revisited Algorithm 2, §IV (MECHANISMS.md §2).

Each one-hot bit gets a backstop ``x' = R_b(x; ε_b)`` drawn ONCE per (device, channel, true
value) and persisted (:class:`BackstopState`); every report sends ``τ`` fresh fragments
``R_f(x'; ε_f)``, row r routed to shuffler ``r mod K``. Wire payload (code 2): ``uint16
fragment index | uint32 bit index``. Local privacy is ``ε(t)`` of Theorem IV.1, capped at
ε_ℓ∞ = ε(τ) only while the backstop is kept: a lost or mismatched state is an error, never a
silent redraw. The estimator debiases both stages.

Estimator, variance and privacy: docs/mechanisms.md, "Report fragments with a privacy backstop".
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.accounting import (
    BackstopFragments,
    Epoch,
    fragment_eps,
    removal_to_replacement,
    rfrag_across_batches,
)
from common.mechanisms._estimates import (
    CountAccumulator,
    Estimate,
    FloatArray,
    IntArray,
    clip_estimate,
)
from common.mechanisms._histogram import check_bins, check_eps, check_value
from common.mechanisms._random import binomial_pmf, geometric_positions, randomized_onehot
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
    StateConflictError,
    compose_epochs,
    epoch_batches,
)
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


def _complement_positions(ones: Sequence[int], rank: IntArray) -> IntArray:
    """Map ranks among the zeros of a sparse 0/1 vector to positions (``ones`` sorted)."""
    ones_arr = np.asarray(ones, dtype=np.int64)
    shifted = ones_arr - np.arange(ones_arr.size)
    result: IntArray = rank + np.searchsorted(shifted, rank, side="right")
    return result


def _row(r: int, ones: list[int], params: RFragParams, rng: RandomSource) -> list[bytes]:
    p = params.fragment_flip
    kept = [i for i in ones if not bernoulli(rng, p)]
    ranks = np.fromiter(geometric_positions(rng, params.k - len(ones), p), dtype=np.int64)
    flipped = _complement_positions(ones, ranks).tolist() if ranks.size else []
    prefix = r.to_bytes(2, "big")
    return [frame(MECHANISM_CODE, prefix + i.to_bytes(4, "big")) for i in sorted(kept + flipped)]


def parse(fragment: bytes, params: RFragParams) -> tuple[int, int]:
    """``(row, bit index)`` of one fragment.

    Raises:
        FragmentError: if it does not parse or is out of range.
    """
    payload = unframe(MECHANISM_CODE, PAYLOAD_SIZE, fragment)
    row, index = int.from_bytes(payload[:2], "big"), int.from_bytes(payload[2:], "big")
    if row >= params.tau or index >= params.k:
        raise FragmentError(
            f"fragment (row={row}, index={index}) outside tau={params.tau}, k={params.k}"
        )
    return row, index


def variance(n: int, params: RFragParams) -> float:
    """Variance of ĉ_j with the shared backstop accounted for (same n on every row)."""
    p_b, p_f, tau = params.backstop_flip, params.fragment_flip, params.tau
    var_sum = n * (tau * p_f * (1 - p_f) + tau**2 * (1 - 2 * p_f) ** 2 * p_b * (1 - p_b))
    return var_sum / (tau * (1 - 2 * p_f) * (1 - 2 * p_b)) ** 2


def simulate_aggregate(
    true_counts: IntArray, params: RFragParams, rng: np.random.Generator
) -> CountAccumulator:
    """Backstop ones ~ Bin(c, 1-p_b) + Bin(n-c, p_b); fragment ones from those, τ per user."""
    counts = np.asarray(true_counts, dtype=np.int64)
    n = int(counts.sum())
    p_b, p_f, tau = params.backstop_flip, params.fragment_flip, params.tau
    backstop_ones = rng.binomial(counts, 1 - p_b) + rng.binomial(n - counts, p_b)
    sums = rng.binomial(tau * backstop_ones, 1 - p_f) + rng.binomial(tau * (n - backstop_ones), p_f)
    return CountAccumulator(sums.astype(np.int64), n, np.full(tau, n, dtype=np.int64))


def rows_of(params: RFragParams, batch: BatchContext) -> list[int]:
    """Rows routed to a shuffler: r with ``r mod K`` its index (ESA-revisited §IV)."""
    return [r for r in range(params.tau) if r % batch.shuffler_count == batch.shuffler_index]


class RFrag(Mechanism[RFragParams, CountAccumulator]):
    """Report fragments with a persistent backstop through the mechanism interface.

    The device state is the :class:`BackstopState` (it must survive restarts: regenerating it
    would void the ε_ℓ∞ cap); row r of a report goes to shuffler ``r mod K``. An epoch's rows
    reach different crowds at different shufflers, certified together by
    :func:`common.accounting.rfrag_across_batches`, which has no dominating pair:
    :meth:`epoch_pair` is None, and the ledger composes each epoch's certificate.
    """

    name = NAME
    code = MECHANISM_CODE
    payload_size = PAYLOAD_SIZE
    randomizer_type = BackstopFragments

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
        return FragmentCount(0, rows * params.k, mean, variance)

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

    def new_accumulator(self, params: RFragParams) -> CountAccumulator:
        """Counts per bit over all rows, plus contributions per row."""
        return CountAccumulator.empty(params.k, rows=params.tau)

    def load_accumulator(self, params: RFragParams, data: bytes) -> CountAccumulator:
        return CountAccumulator.from_bytes(data)

    def accumulate(
        self,
        params: RFragParams,
        accumulator: CountAccumulator,
        fragments: Sequence[bytes],
        n_contributions: int,
        batch: BatchContext,
    ) -> int:
        """Count one batch; its contributions carried the rows routed to ``batch``'s shuffler."""
        indices: list[int] = []
        invalid = 0
        for fragment in fragments:
            try:
                indices.append(parse(fragment, params)[1])
            except FragmentError:
                invalid += 1
        accumulator.add(np.asarray(indices, dtype=np.int64), 0)
        carried = rows_of(params, batch)
        accumulator.rows[carried] += n_contributions
        accumulator.n = int(accumulator.rows.max()) if accumulator.rows.size else 0
        return invalid

    def estimate(
        self, params: RFragParams, accumulator: CountAccumulator, clip: bool = False
    ) -> Estimate:
        """Two-stage debiased counts (fragment flip, then backstop flip)."""
        p_b, p_f, tau = params.backstop_flip, params.fragment_flip, params.tau
        base = p_f + (1 - 2 * p_f) * p_b
        scale = tau * (1 - 2 * p_f) * (1 - 2 * p_b)
        values: FloatArray = (accumulator.counts - base * accumulator.rows.sum()) / scale
        n = round(float(accumulator.rows.mean())) if accumulator.rows.size else 0
        std = np.full(params.k, math.sqrt(variance(n, params)))
        note = "two-stage debiasing (ESA-revisited §IV)" + (
            "; negatives clipped to 0" if clip else ""
        )
        return Estimate(
            values=clip_estimate(values, clip), std_errors=std, n=n, clipped=clip, note=note
        )

    def local_privacy(self, params: RFragParams) -> LocalPrivacy:
        """Theorem IV.1: removal ε_ℓ∞ = ε(τ), ε_ℓ1 = ε(1); replacement touches two bits: 2 ε(τ)."""
        eps_inf = fragment_eps(params.eps_b, params.eps_f, params.tau)
        eps_one = fragment_eps(params.eps_b, params.eps_f, 1)
        return LocalPrivacy(
            removal=eps_inf,
            replacement=2 * eps_inf,
            eps_l_inf=eps_inf,
            eps_l1=eps_one,
            note="Theorem IV.1",
        )

    def bin_count_law(self, params: RFragParams, value: int, bins: tuple[int, int]) -> FloatArray:
        """Per bit: the backstop is binary RR at ε_b, then each of τ rows binary RR at ε_f of
        the backstop (Algorithm 2); a bin's count is over all τ rows, bits independent."""
        high = binomial_pmf(params.tau, 1.0 - params.fragment_flip)
        low = binomial_pmf(params.tau, params.fragment_flip)

        def count(own: bool) -> FloatArray:
            one = 1.0 - params.backstop_flip if own else params.backstop_flip
            law: FloatArray = one * high + (1.0 - one) * low
            return law

        return np.outer(*(count(value == b) for b in bins))

    def privacy(self, params: RFragParams) -> PrivacyDescription:
        """The backstop argument at ε_b when every row reached the same users (removal);
        :meth:`certify` uses :func:`common.accounting.rfrag_across_batches` instead."""
        return PrivacyDescription(
            BackstopFragments(eps_f=params.eps_f, tau=params.tau), params.eps_b
        )

    def epoch_pair(
        self,
        params: RFragParams,
        n: int,
        delta: float,
        *,
        deletion: tuple[float, float] | None = None,
        replacement: bool = False,
    ) -> Epoch | None:
        """None: rows reach different crowds at different shufflers, which no dominating
        pair covers; the ledger composes each epoch's certificate."""
        return None

    def certify(
        self, params: RFragParams, delta: float, received: Sequence[Received[CountAccumulator]]
    ) -> ReleaseCertificate:
        """Shufflers run randomized deletion independently, so their batches hold different
        users: each epoch is certified by :func:`common.accounting.rfrag_across_batches` over
        its batches, and epochs compose."""
        rows: dict[str, int] = {
            item.shuffler_id: max(1, len(rows_of(params, item.source))) for item in received
        }
        per_epoch = epoch_batches(received)
        if not per_epoch:
            raise NoDataError("no batch received")
        results = []
        for crowds in per_epoch.values():
            keys = sorted(crowds)
            results.append(
                rfrag_across_batches(
                    params.eps_b,
                    params.eps_f,
                    [crowds[key] for key in keys],
                    [rows[key.split("#")[0]] for key in keys],
                    delta,
                )
            )
        others = [removal_to_replacement(r, independent_parts=False) for r in results]
        crowds_flat = {f"{e}/{k}": v for e, c in per_epoch.items() for k, v in c.items()}
        return ReleaseCertificate(
            certified=compose_epochs(results),
            other=compose_epochs(others),
            lower=None,
            crowds=crowds_flat,
            epochs=len(per_epoch),
        )

    def encode_rows(
        self, params: RFragParams, value: int, state: BackstopState, rng: RandomSource
    ) -> list[list[bytes]]:
        """τ rows of fragments for one report; row r goes to shuffler ``r mod K``."""
        value = check_value(value, params.k)
        ones = state.backstop(value, params, rng)
        return [_row(r, ones, params, rng) for r in range(params.tau)]
