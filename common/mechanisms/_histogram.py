"""Index histograms on the analyzer (k-RAPPOR, k-RR and Balcer–Cheu share them): parsing,
accumulation and certification of uint32-index fragments (their encoding:
:mod:`common.mechanisms.device._histogram`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from common.accounting import Certification
from common.mechanisms._estimates import CountAccumulator, IntArray
from common.mechanisms._wire import FragmentError, unframe
from common.mechanisms.base import (
    Mechanism,
    Received,
    ReleaseCertificate,
    certify_smallest_batch,
)
from common.mechanisms.device import BatchContext, P
from common.mechanisms.device._histogram import IndexEncoder


def parse_indices(code: int, k: int, fragments: Iterable[bytes]) -> tuple[IntArray, int]:
    """Parse uint32-index fragments; return the valid indices and the number of invalid ones."""
    valid: list[int] = []
    invalid = 0
    for fragment in fragments:
        try:
            index = int.from_bytes(unframe(code, 4, fragment), "big")
        except FragmentError:
            invalid += 1
            continue
        if index >= k:
            invalid += 1
            continue
        valid.append(index)
    return np.asarray(valid, dtype=np.int64), invalid


class IndexHistogram(IndexEncoder[P], Mechanism[P, CountAccumulator]):
    """A histogram mechanism whose fragments are uint32 bin indices, one contribution each
    (k-RAPPOR, k-RR, Balcer–Cheu): accumulation and certification shared."""

    def certify_crowd(self, params: P, n: int, delta: float) -> Certification:
        """The certificate of one batch of n contributions."""
        return self.privacy(params).certify(n, delta)

    def new_accumulator(self, params: P) -> CountAccumulator:
        return CountAccumulator.empty(self.domain_size(params))

    def load_accumulator(self, params: P, data: bytes) -> CountAccumulator:
        return CountAccumulator.from_bytes(data)

    def accumulate(
        self,
        params: P,
        accumulator: CountAccumulator,
        fragments: Sequence[bytes],
        n_contributions: int,
        batch: BatchContext,
    ) -> int:
        """Count one batch of uint32-index fragments; returns how many were invalid (chaff)."""
        indices, invalid = parse_indices(self.code, self.domain_size(params), fragments)
        accumulator.add(indices, n_contributions)
        return invalid

    def certify(
        self, params: P, delta: float, received: Sequence[Received[CountAccumulator]]
    ) -> ReleaseCertificate:
        return certify_smallest_batch(received, lambda n: self.certify_crowd(params, n, delta))
