"""Estimates and the dense-count accumulator shared by the histogram mechanisms."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Two-sided 95% normal quantile.
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Estimate:
    """Debiased estimates with their standard errors.

    Attributes:
        values: One estimate per bin (or per period for longitudinal channels).
        std_errors: Standard error of each estimate (of the unclipped estimator).
        n: Contributions the estimate is based on.
        clipped: Whether negative estimates were clipped to 0 (changes the bias, not the SE).
        note: How the estimate was formed.
        truncated: The paper's own estimate where it truncates (Balcer–Cheu Figure 1 zeroes
            small bins), kept beside the unbiased ``values``; None for other mechanisms.
    """

    values: FloatArray
    std_errors: FloatArray
    n: int
    clipped: bool = False
    note: str = ""
    truncated: FloatArray | None = None

    def interval(self, z: float = Z95) -> tuple[FloatArray, FloatArray]:
        """Normal-approximation confidence interval ``values ± z · std_errors``."""
        return self.values - z * self.std_errors, self.values + z * self.std_errors

    def top(self, count: int) -> IntArray:
        """Indices of the ``count`` largest estimates, largest first."""
        count = min(count, self.values.size)
        order = np.argpartition(-self.values, count - 1)[:count]
        result: IntArray = order[np.argsort(-self.values[order])].astype(np.int64)
        return result


def clip_estimate(values: FloatArray, clip: bool) -> FloatArray:
    """Optionally clip negative estimates to zero (ESA-revisited's RMSE figures do)."""
    return np.maximum(values, 0.0) if clip else values


@dataclass
class CountAccumulator:
    """Sufficient statistics of a histogram channel: count per bin and contributions seen.

    ``rows`` holds per-fragment-index contribution counts for mechanisms that split a report
    into rows (report fragments); it is empty otherwise.
    """

    counts: IntArray
    n: int = 0
    rows: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @classmethod
    def empty(cls, bins: int, rows: int = 0) -> CountAccumulator:
        """A zero accumulator over ``bins`` bins."""
        return cls(np.zeros(bins, dtype=np.int64), 0, np.zeros(rows, dtype=np.int64))

    def add(self, bins: IntArray, n_contributions: int) -> None:
        """Count one batch: the bin of every valid fragment, and the batch's contributions."""
        np.add.at(self.counts, bins, 1)
        self.n += n_contributions

    def merge(self, other: CountAccumulator) -> CountAccumulator:
        """Sum of two accumulators over the same bins."""
        if other.counts.shape != self.counts.shape or other.rows.shape != self.rows.shape:
            raise ValueError(
                f"cannot merge accumulators of shapes {self.counts.shape}/{self.rows.shape} "
                f"and {other.counts.shape}/{other.rows.shape}"
            )
        return CountAccumulator(
            self.counts + other.counts, self.n + other.n, self.rows + other.rows
        )

    def to_bytes(self) -> bytes:
        """Compressed, pickle-free serialization."""
        buffer = io.BytesIO()
        np.savez_compressed(buffer, counts=self.counts, n=np.array([self.n]), rows=self.rows)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> CountAccumulator:
        """Inverse of :meth:`to_bytes`."""
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            return cls(
                arrays["counts"].astype(np.int64),
                int(arrays["n"][0]),
                arrays["rows"].astype(np.int64),
            )
