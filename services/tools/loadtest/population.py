"""True values of a simulated population, per channel (``--population CHANNEL=SPEC``).

A spec (``zipf[:S]``, ``uniform``, ``horse``, ``camera``, ``hubble``, ``words``, ``csv:PATH``)
becomes true counts rescaled to the number of devices (largest remainder), then one value per
device in a seeded random order: the values are the data measured, not privacy noise (that
comes from the OS CSPRNG). A longitudinal channel takes ``changes[:RATE]``: each device changes
state ``Binomial(k, RATE)`` times at seeded random periods
(:func:`services.tools.populations.longitudinal`); the truth per period is the number of devices
in state 1, the sum Algorithm 2 of Erlingsson et al. 2019 estimates.

The specs: docs/loadtest.md, "Populations".
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from common.mechanisms.longitudinal import ChangeLog
from common.wire import ChannelConfig
from services.tools import populations

IntArray = npt.NDArray[np.int64]
IMAGES = ("horse", "camera", "hubble")


class PopulationError(ValueError):
    """A population spec that cannot be used for a channel (names the spec and why)."""


@dataclass(frozen=True)
class Population:
    """One channel's devices' values (over ``0..k-1``) and the truth they add up to."""

    channel_id: str
    spec: str
    values: IntArray
    k: int
    #: A longitudinal channel's changes (``k`` is then its number of periods d).
    changes: ChangeLog | None = None

    @property
    def counts(self) -> IntArray:
        """Devices per value; for a longitudinal channel, devices in state 1 per period."""
        if self.changes is not None:
            return self.changes.true_counts()
        found: IntArray = np.bincount(self.values, minlength=self.k).astype(np.int64)
        return found

    def change_periods(self) -> list[list[int]]:
        """Per device, the periods (1..d) at which it changes state (longitudinal only)."""
        found: list[list[int]] = [[] for _ in range(self.values.size)]
        if self.changes is not None:
            for user, period in zip(self.changes.user, self.changes.period, strict=True):
                found[int(user)].append(int(period))
        return found


def _zipf(k: int, s: float) -> npt.NDArray[np.float64]:
    weights: npt.NDArray[np.float64] = 1.0 / np.arange(1, k + 1, dtype=np.float64) ** s
    return np.asarray(weights / weights.sum(), dtype=np.float64)


def _from_csv(path: Path, k: int) -> IntArray:
    """Counts from a CSV of values (one per line) or ``value,count`` rows."""
    counts = np.zeros(k, dtype=np.int64)
    try:
        with path.open(newline="") as handle:
            for row in csv.reader(handle):
                if not row or row[0].strip().startswith("#"):
                    continue
                value = int(row[0])
                if not 0 <= value < k:
                    raise PopulationError(f"{path}: value {value} is outside 0..{k - 1}")
                counts[value] += int(row[1]) if len(row) > 1 else 1
    except (OSError, ValueError) as error:
        raise PopulationError(f"csv population {path}: {error}") from error
    return counts


def _dataset(name: str, channel: ChannelConfig, k: int) -> IntArray:
    if name == "words":
        counts = populations.words(n=1_000_000, top=k).counts
    else:
        from skimage import transform

        full = populations.image(name)
        assert full.shape is not None
        shape = channel.image_shape or (1, k)
        if shape[0] * shape[1] != k:
            raise PopulationError(f"{name}: image shape {shape} does not hold k = {k} values")
        resize: Any = transform.resize  # scikit-image ships no type hints
        pixels = resize(full.counts.reshape(full.shape).astype(np.float64), shape)
        counts = np.round(np.asarray(pixels) * 1000).astype(np.int64).ravel()
    if counts.size != k:
        raise PopulationError(f"dataset {name!r} has {counts.size} values, channel k = {k}")
    return counts


def counts_for(spec: str, channel: ChannelConfig, k: int, devices: int, seed: int) -> IntArray:
    """True counts of ``devices`` respondents over ``0..k-1`` for ``spec``.

    Raises:
        PopulationError: unknown spec, unreadable CSV or a dataset that does not fit.
    """
    rng = np.random.default_rng(seed)
    kind, _, arg = spec.partition(":")
    if kind == "zipf":
        s = float(arg) if arg else 1.1
        return rng.multinomial(devices, _zipf(k, s)).astype(np.int64)
    if kind == "uniform":
        return rng.multinomial(devices, np.full(k, 1.0 / k)).astype(np.int64)
    if kind in (*IMAGES, "words"):
        base = _dataset(kind, channel, k)
    elif kind == "csv":
        base = _from_csv(Path(arg), k)
    else:
        raise PopulationError(
            f"population {spec!r}: use zipf[:S], uniform, {', '.join(IMAGES)}, words or csv:PATH"
        )
    if base.sum() == 0:
        raise PopulationError(f"population {spec!r} holds no respondents")
    return populations.rescale(base, devices)


def draw(spec: str, channel: ChannelConfig, k: int, devices: int, seed: int) -> Population:
    """One value per device, so that they add up to :func:`counts_for`."""
    counts = counts_for(spec, channel, k, devices, seed)
    rng = np.random.default_rng(seed + 1)
    values: IntArray = rng.permutation(np.repeat(np.arange(k), counts)).astype(np.int64)
    return Population(channel_id=channel.id, spec=spec, values=values, k=k)


def is_changes(spec: str) -> bool:
    """Whether ``spec`` is a longitudinal channel's (``changes[:RATE]``)."""
    return spec.partition(":")[0] == "changes"


def draw_changes(spec: str, channel_id: str, d: int, k: int, devices: int, seed: int) -> Population:
    """``devices`` devices over ``d`` periods, each changing state ``Binomial(k, RATE)`` times.

    Raises:
        PopulationError: not a ``changes[:RATE]`` spec, or RATE outside [0, 1].
    """
    kind, _, arg = spec.partition(":")
    try:
        if kind != "changes":
            raise ValueError("use changes or changes:RATE for a longitudinal channel")
        rate = float(arg) if arg else 0.5
        drawn = populations.longitudinal(devices, d, k, change_rate=rate, seed=seed)
    except ValueError as error:
        raise PopulationError(f"population {spec!r} of {channel_id}: {error}") from error
    values: IntArray = np.zeros(devices, dtype=np.int64)
    return Population(channel_id=channel_id, spec=spec, values=values, k=d, changes=drawn.changes)
