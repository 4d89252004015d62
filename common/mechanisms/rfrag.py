"""Report fragments with a privacy backstop — ESA-revisited Algorithm 2, §IV (docs/mechanisms.md).

Each one-hot bit gets a backstop ``x' = R_b(x; ε_b)`` drawn ONCE per (device, channel, true
value) and persisted (:class:`BackstopState`); every report sends ``τ`` fresh fragments
``R_f(x'; ε_f)``, row r routed to shuffler ``r mod K``. Wire payload (code 2): ``uint16
fragment index | uint32 bit index``. Local privacy is ``ε(t)`` of Theorem IV.1, capped at
ε_ℓ∞ = ε(τ) only while the backstop is kept: a lost or mismatched state is an error, never a
silent redraw. The estimator debiases both stages. The device facet (parameters, backstop
state, encoding, local privacy) is :mod:`common.mechanisms.device.rfrag`.

Estimator, variance and privacy: docs/mechanisms.md, "Report fragments with a privacy backstop".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from common.accounting import (
    BackstopFragments,
    Epoch,
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
from common.mechanisms._random import binomial_pmf
from common.mechanisms._wire import FragmentError, unframe
from common.mechanisms.base import (
    Mechanism,
    NoDataError,
    PrivacyDescription,
    Received,
    ReleaseCertificate,
    compose_epochs,
    epoch_batches,
)
from common.mechanisms.device import BatchContext
from common.mechanisms.device.rfrag import (
    MAX_TAU,
    MECHANISM_CODE,
    NAME,
    PAYLOAD_SIZE,
    BackstopState,
    BackstopStateError,
    RFragDevice,
    RFragParams,
    new_state,
    rows_of,
)

__all__ = [
    "MAX_TAU",
    "MECHANISM_CODE",
    "NAME",
    "PAYLOAD_SIZE",
    "BackstopState",
    "BackstopStateError",
    "RFrag",
    "RFragDevice",
    "RFragParams",
    "new_state",
    "parse",
    "rows_of",
    "simulate_aggregate",
    "variance",
]


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


class RFrag(RFragDevice, Mechanism[RFragParams, CountAccumulator]):
    """Report fragments with a persistent backstop through the mechanism interface.

    An epoch's rows reach different crowds at different shufflers, certified together by
    :func:`common.accounting.rfrag_across_batches`, which has no dominating pair:
    :meth:`epoch_pair` is None, and the ledger composes each epoch's certificate.
    """

    randomizer_type = BackstopFragments

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
