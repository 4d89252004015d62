"""Simulated populations for load tests and paper-scale reproduction (ESA-revisited §VII).

Every population is a vector of true counts (respondents per value), built from data shipped in
installed packages, never downloaded: ``heavy_hitters`` (§VII-A: about a hundred heavy hitters
with 30% of the mass, the rest ``p(x) ∝ x^-1.35`` over 1,778,120 values; the paper publishes no
mixture weights), ``image`` (scikit-image's ``horse``, ``camera``, ``hubble_deep_field``: pixel
luminosity as respondents, §VII-B; ``horse`` is a silhouette, its pixels at 255), ``words``
(``wordfreq``) and ``longitudinal`` (n users over d periods, at most k state changes each).
Optional ``n`` rescales a histogram population to exactly n respondents (largest remainder).

Where these differ from the paper's data: docs/reproduction.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from common.mechanisms.longitudinal import ChangeLog

IntArray = npt.NDArray[np.int64]

TABLE_I_N = 203_950_512
TABLE_I_K = 1_778_120
HEAVY_HITTERS = 100
HEAVY_MASS = 0.3
POWER_LAW = 1.35
DATASETS = ("zipf", "horse", "camera", "hubble", "words")


@dataclass(frozen=True)
class HistogramPopulation:
    """True counts per value, with how to show them.

    Attributes:
        name: Dataset name.
        counts: Respondents per value (length k).
        shape: Image shape for image datasets (counts are the row-major pixels).
        labels: A label per value (words), if any.
        note: Where the data comes from and how it was transformed.
    """

    name: str
    counts: IntArray
    shape: tuple[int, int] | None = None
    labels: tuple[str, ...] | None = None
    note: str = ""

    @property
    def n(self) -> int:
        """Number of respondents."""
        return int(self.counts.sum())

    @property
    def k(self) -> int:
        """Domain size."""
        return int(self.counts.size)

    def values(self, rng: np.random.Generator) -> IntArray:
        """Every respondent's value, in random order (for the per-report path)."""
        result: IntArray = rng.permutation(np.repeat(np.arange(self.k), self.counts))
        return result


@dataclass(frozen=True)
class LongitudinalPopulation:
    """A change log plus the parameters it was drawn with."""

    changes: ChangeLog
    k: int
    extra: dict[str, float] = field(default_factory=dict)


def rescale(counts: IntArray, n: int) -> IntArray:
    """Scale counts to sum to exactly ``n`` (largest-remainder rounding).

    Raises:
        ValueError: if n < 1 or the counts are all zero.
    """
    total = int(counts.sum())
    if n < 1 or total == 0:
        raise ValueError(f"cannot rescale {total} respondents to n={n}")
    exact = counts.astype(np.float64) * (n / total)
    floor = np.floor(exact).astype(np.int64)
    short = n - int(floor.sum())
    if short:
        floor[np.argsort(floor - exact, kind="stable")[:short]] += 1
    return floor


def heavy_hitters(n: int = TABLE_I_N, k: int = TABLE_I_K, seed: int = 0) -> HistogramPopulation:
    """Heavy hitters + power law (ESA-revisited §VII-A, Table III "Heavy-hitter")."""
    if k <= HEAVY_HITTERS:
        raise ValueError(f"k must exceed {HEAVY_HITTERS} heavy hitters, got k={k}")
    heavy = 1.0 / np.arange(1, HEAVY_HITTERS + 1)
    tail = np.arange(1, k - HEAVY_HITTERS + 1, dtype=np.float64) ** -POWER_LAW
    probs = np.concatenate([HEAVY_MASS * heavy / heavy.sum(), (1 - HEAVY_MASS) * tail / tail.sum()])
    counts = np.random.default_rng(seed).multinomial(n, probs).astype(np.int64)
    note = f"{HEAVY_HITTERS} heavy hitters ({HEAVY_MASS:.0%} of mass) + x^-{POWER_LAW} power law"
    return HistogramPopulation(name="zipf", counts=counts, note=note)


def _image_array(name: str) -> npt.NDArray[np.float64]:
    from skimage import color, data

    images: Any = data  # scikit-image ships no type hints
    if name == "horse":
        return np.where(images.horse(), 0.0, 255.0)
    if name == "camera":
        return np.asarray(images.camera(), dtype=np.float64)
    if name == "hubble":
        gray: Any = color.rgb2gray(images.hubble_deep_field())
        return np.round(np.asarray(gray, dtype=np.float64) * 255.0)
    raise ValueError(f"unknown image {name!r}; choose horse, camera or hubble")


def image(name: str, n: int | None = None) -> HistogramPopulation:
    """Pixel luminosity as respondents (ESA-revisited §VII-B), optionally rescaled to n."""
    pixels = _image_array(name)
    counts = np.round(pixels).astype(np.int64).ravel()
    note = (
        f"scikit-image {name}, {pixels.shape[0]}x{pixels.shape[1]} pixels, luminosity = respondents"
    )
    if n is not None:
        counts = rescale(counts, n)
        note += f", rescaled to n={n}"
    shape = (int(pixels.shape[0]), int(pixels.shape[1]))
    return HistogramPopulation(name=name, counts=counts, shape=shape, note=note)


def words(n: int = 1_000_000, top: int = 10_000, lang: str = "en") -> HistogramPopulation:
    """The ``top`` most frequent words of ``lang`` with their real frequencies, scaled to n."""
    import wordfreq

    vocabulary = wordfreq.top_n_list(lang, top)
    freqs = np.array([wordfreq.word_frequency(w, lang) for w in vocabulary], dtype=np.float64)
    counts = rescale(np.round(freqs * 1e9).astype(np.int64), n)
    note = f"wordfreq top {top} {lang} words, frequencies scaled to n={n}"
    return HistogramPopulation(name="words", counts=counts, labels=tuple(vocabulary), note=note)


def histogram(dataset: str, n: int | None = None, seed: int = 0) -> HistogramPopulation:
    """A population by name (``esa simulate histogram --dataset``)."""
    if dataset == "zipf":
        return heavy_hitters(n or TABLE_I_N, seed=seed)
    if dataset in ("horse", "camera", "hubble"):
        return image(dataset, n)
    if dataset == "words":
        return words(n or 1_000_000)
    raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got dataset={dataset!r}")


def _concat(parts: list[IntArray]) -> IntArray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def longitudinal(
    n: int, d: int, k: int, change_rate: float = 0.5, seed: int = 0, over_k: float = 0.0
) -> LongitudinalPopulation:
    """n users over d periods; each changes state ``Bin(k, change_rate)`` times (at most k).

    A fraction ``over_k`` of users gets two extra changes beyond k (to show they are ignored).
    States start at 0 and alternate, so changes alternate +1, -1, +1, ...
    """
    if not 0 <= change_rate <= 1 or not 0 <= over_k <= 1:
        raise ValueError(f"change_rate and over_k must be in [0, 1], got {change_rate}, {over_k}")
    rng = np.random.default_rng(seed)
    per_user = rng.binomial(k, change_rate, size=n)
    extra = rng.random(n) < over_k
    per_user = np.where(extra, np.minimum(k + 2, d), np.minimum(per_user, d))
    users: list[IntArray] = []
    periods: list[IntArray] = []
    signs: list[IntArray] = []
    for count in np.unique(per_user[per_user > 0]):
        who = np.flatnonzero(per_user == count)
        times = np.sort(rng.random((who.size, d)).argsort(axis=1)[:, :count] + 1, axis=1)
        users.append(np.repeat(who, count))
        periods.append(times.ravel())
        signs.append(np.tile(np.where(np.arange(count) % 2 == 0, 1, -1), who.size))
    log = ChangeLog(
        n_users=n, d=d, user=_concat(users), period=_concat(periods), sign=_concat(signs)
    )
    return LongitudinalPopulation(log, k, {"change_rate": change_rate, "over_k": over_k})
