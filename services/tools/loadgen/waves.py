"""A longitudinal channel's reports in waves of one epoch each (at most one report per device
in it): what an epoch's end left unsent goes in a later wave, so a slow machine takes more
epochs and never loses a period."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from common.mechanisms import build
from common.wire import ChannelConfig
from services.tools.loadgen.devices import SealerPool
from services.tools.loadgen.target import LoadError

#: Waves in a row that may hand out nothing before a longitudinal phase gives up: each was
#: sealed for an epoch that ended before its sealing did.
EMPTY_WAVES = 3


@dataclass(frozen=True)
class Wave:
    """One epoch of a longitudinal phase: the epoch, the latest period (1-based) its reports
    may be of, its request files (one per worker) and how many requests they hold."""

    epoch: int
    period: int
    files: list[Path]
    requests: int


class SeriesWaves:
    """A longitudinal channel's reports (:meth:`SealerPool.add_series`) sent in waves, one
    epoch each: wave w holds every device's earliest unsent report of a period up to w, at
    most one per device (a shuffler takes one contribution per client, channel and epoch).
    A report left unsent when its epoch ended goes in a later wave, sealed anew for that
    epoch; the analyzer reads each report's period from the report itself (Erlingsson et al.
    2019, Algorithm 2), never from the epoch, so a slow machine takes more epochs and never
    loses a period. With nothing slow, wave t is period t, as devices in the field send it.
    """

    def __init__(
        self, pool: SealerPool, channel: ChannelConfig, directory: Path, seal_rate: float
    ) -> None:
        self.pool, self.channel, self.directory = pool, channel, directory
        #: Outer envelopes sealed per second: a guess until a wave measures it.
        self.seal_rate = seal_rate
        self.waves: list[Wave] = []
        #: Requests sealed that their epoch ended before sending (sent again later).
        self.rolled_over = 0
        self._pending: int | None = None
        self._empty = 0

    @property
    def epochs(self) -> list[int]:
        """The epochs of the waves so far."""
        return [wave.epoch for wave in self.waves]

    def next_wave(self) -> Wave | None:
        """Seal the next wave for the first epoch that starts after the sealing is likely
        done (never the previous wave's); None once every report is sent."""
        if self._pending == 0:
            return None
        seconds = self.channel.epoch_seconds
        devices = sum(self.pool.shards.get(self.channel.id, [0]))
        ahead = 1.0 + devices / max(self.seal_rate, 1.0)
        after = self.waves[-1].epoch + 1 if self.waves else 0
        epoch = max(after, int((time.time() + ahead) // seconds))
        period = len(self.waves) + 1
        files, timing = self.pool.seal_wave(epoch, period - 1, self.directory, self.channel.id)
        if timing.items:
            self.seal_rate = timing.rate
        self.waves.append(Wave(epoch, period, files, timing.items))
        return self.waves[-1]

    def settle(self, handed: set[str]) -> int:
        """The last wave was sent as far as ``handed`` (its requests' tokens) says; returns
        how many periods are complete (every report of them sent).

        Raises:
            LoadError: :data:`EMPTY_WAVES` waves in a row sent nothing.
        """
        wave = self.waves[-1]
        self.rolled_over += wave.requests - len(handed)
        self._pending, earliest = self.pool.settle(self.channel.id, handed)
        self._empty = 0 if handed or not wave.requests else self._empty + 1
        if self._empty >= EMPTY_WAVES:
            raise LoadError(
                f"{self.channel.id}: {EMPTY_WAVES} waves in a row sent nothing: sealing "
                f"{wave.requests:,} reports takes longer than a {self.channel.epoch_seconds}-s "
                "epoch on this machine (fewer devices, or more sealing workers)"
            )
        return self._periods(earliest)

    def _periods(self, earliest: int | None) -> int:
        total = build(self.channel).domain_size()
        return total if earliest is None else earliest
