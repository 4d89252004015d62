"""The run phase: replay the prepared contributions and show what happens, live (rich).

Every second a sample: offered (requests handed to a connection) and accepted (202) rate,
p50/p95/p99 latency of the answers in that second, errors by status, the same per shuffler, and
the resident memory of each local service's process tree when the deployment runs here.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from services.tools import loadgen
from services.tools.loadgen import ChannelSource

SAMPLE_SECONDS = 1.0
#: Without a live view, a wait of the run says how long is left this often.
WAIT_LINE_SECONDS = 10.0
#: Waits shorter than this go unannounced.
QUIET_WAIT_SECONDS = 1.0


@dataclass
class Monitor:
    """Samples of one run (and the processes whose memory to sample)."""

    driver: loadgen.Driver
    shuffler_urls: list[str]
    local: Mapping[str, int] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    #: What the run waits for now, with the seconds left (the live view's title shows it).
    waiting: str = ""

    def sample(self, last: dict[str, Any]) -> dict[str, Any]:
        """One sample since ``last`` (the previous sample, or {} at the start)."""
        stats, now = self.driver.stats, time.monotonic()
        window = sorted(stats.take_window())
        span = max(1e-9, now - last.get("_at", self.started))
        per = {
            self.shuffler_urls[i]: dict(counts) for i, counts in sorted(stats.by_shuffler.items())
        }
        before = last.get("_per", {})
        sample: dict[str, Any] = {
            "t": round(now - self.started, 2),
            "offered": self.driver.sent,
            "accepted": stats.accepted,
            "offered_per_s": round((self.driver.sent - last.get("offered", 0)) / span, 1),
            "accepted_per_s": round((stats.accepted - last.get("accepted", 0)) / span, 1),
            "p50_ms": _ms(loadgen.percentile(window, 0.50)),
            "p95_ms": _ms(loadgen.percentile(window, 0.95)),
            "p99_ms": _ms(loadgen.percentile(window, 0.99)),
            "errors": stats.errors,
            "per_shuffler": {
                url: {
                    "accepted_per_s": round(
                        (c.get(202, 0) - before.get(url, {}).get(202, 0)) / span, 1
                    ),
                    "errors": {str(k): v for k, v in c.items() if k != 202},
                }
                for url, c in per.items()
            },
            "rss_mb": {
                name: round(loadgen.process_usage(pid).rss_bytes / 2**20, 1)
                for name, pid in self.local.items()
            },
            "load_1min": round(os.getloadavg()[0], 2),
            "_at": now,
            "_per": per,
        }
        self.samples.append(sample)
        return sample


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1e3, 2)


def view(sample: dict[str, Any], title: str, waiting: str = "") -> Group:
    """The live view of one sample (and what the run waits for, if it waits)."""
    heading = f"{title} — {sample['t']:.0f} s" + (f"\n{waiting}" if waiting else "")
    head = Table(title=heading, show_header=True)
    for column in ("offered/s", "accepted/s", "accepted", "p50 ms", "p95 ms", "p99 ms", "errors"):
        head.add_column(column, justify="right")
    errors = ", ".join(f"{k}: {v:,}" for k, v in sample["errors"].items()) or "none"
    head.add_row(
        f"{sample['offered_per_s']:,.0f}",
        f"{sample['accepted_per_s']:,.0f}",
        f"{sample['accepted']:,}",
        *(str(sample[k]) for k in ("p50_ms", "p95_ms", "p99_ms")),
        errors,
    )
    shufflers = Table(show_header=True)
    shufflers.add_column("shuffler")
    shufflers.add_column("accepted/s", justify="right")
    shufflers.add_column("errors by status")
    for url, row in sample["per_shuffler"].items():
        found = ", ".join(f"{k}: {v:,}" for k, v in row["errors"].items()) or "none"
        shufflers.add_row(url, f"{row['accepted_per_s']:,.0f}", found)
    parts: list[Table] = [head, shufflers]
    if sample["rss_mb"]:
        memory = Table(show_header=True)
        memory.add_column("service")
        memory.add_column("RSS MiB", justify="right")
        for name, mb in sample["rss_mb"].items():
            memory.add_row(name, f"{mb:,.0f}")
        parts.append(memory)
    return Group(*parts)


async def _sampling(monitor: Monitor, display: Live | None, title: str) -> None:
    last: dict[str, Any] = {}
    while True:
        await asyncio.sleep(SAMPLE_SECONDS)
        last = monitor.sample(last)
        if display is not None:
            display.update(view(last, title, monitor.waiting))


def _left(at: float, what: str) -> str:
    """``waiting for WHAT: 42 s left (until 14:00:00)``."""
    left, until = max(0.0, at - time.time()), time.strftime("%H:%M:%S", time.localtime(at))
    return f"waiting for {what}: {left:.0f} s left (until {until})"


def wait_until(at: float, what: str, console: Console, live: bool) -> None:
    """Sleep until unix time ``at``, saying what for: one line, then a countdown (a status
    line with ``live``, else a line every :data:`WAIT_LINE_SECONDS`); a wait shorter than
    :data:`QUIET_WAIT_SECONDS` goes unannounced."""
    if at - time.time() < QUIET_WAIT_SECONDS:
        time.sleep(max(0.0, at - time.time()))
        return
    console.log(_left(at, what))
    if live:
        with console.status(_left(at, what)) as status:
            while (left := at - time.time()) > 0:
                time.sleep(min(0.5, left))
                status.update(_left(at, what))
        return
    while (left := at - time.time()) > 0:
        time.sleep(min(WAIT_LINE_SECONDS, left))
        if at - time.time() >= QUIET_WAIT_SECONDS:
            console.log(_left(at, what))


async def _wait_in_view(
    at: float, what: str, monitor: Monitor, console: Console, live: bool
) -> None:
    """:func:`wait_until` inside a live view: the countdown is in its title."""
    if at - time.time() < QUIET_WAIT_SECONDS:
        await asyncio.sleep(max(0.0, at - time.time()))
        return
    console.log(_left(at, what))
    try:
        while (left := at - time.time()) > 0:
            monitor.waiting = _left(at, what)
            await asyncio.sleep(min(0.5 if live else WAIT_LINE_SECONDS, left))
            if not live and at - time.time() >= QUIET_WAIT_SECONDS:
                console.log(_left(at, what))
    finally:
        monitor.waiting = ""


async def replay(
    monitor: Monitor,
    source: loadgen.Source,
    rate: float | loadgen.Pace | None,
    seconds: float,
    console: Console,
    live: bool = True,
) -> float:
    """Send at ``rate`` for ``seconds`` (stop early once every prepared request is sent),
    sampling every second; returns the run's seconds."""
    monitor.started = time.monotonic()
    with (
        Live(Table(title="esa loadtest: starting"), console=console, refresh_per_second=2)
        if live
        else _Null() as display
    ):
        task = asyncio.create_task(_sampling(monitor, display if live else None, "esa loadtest"))
        try:
            return await monitor.driver.run(source, rate, seconds, until_empty=True)
        finally:
            task.cancel()
            monitor.sample(monitor.samples[-1] if monitor.samples else {})


async def replay_waves(
    monitor: Monitor,
    waves: loadgen.SeriesWaves,
    rate: float | None,
    console: Console,
    live: bool = True,
) -> float:
    """A longitudinal channel's phase: its waves (:class:`loadgen.SeriesWaves`), each sealed
    and then sent during its own epoch, what an epoch's end left unsent going in a later
    wave, sampling every second. Returns the seconds from the start of the first wave's
    epoch to the last answer."""
    channel, seconds = waves.channel.id, waves.channel.epoch_seconds
    title = f"esa loadtest: {channel}, periods in waves of one {seconds}-s epoch"
    monitor.started = time.monotonic()
    with (
        Live(Table(title=title), console=console, refresh_per_second=2) if live else _Null()
    ) as display:
        task = asyncio.create_task(_sampling(monitor, display if live else None, title))
        try:
            while (wave := await asyncio.to_thread(waves.next_wave)) is not None:
                what = f"epoch {wave.epoch}, which {channel}'s wave {wave.period} goes in"
                await _wait_in_view(wave.epoch * seconds + 0.05, what, monitor, console, live)
                source = ChannelSource({channel: {wave.epoch: wave.files}}, {channel: seconds})
                left = (wave.epoch + 1) * seconds - time.time()
                # Past the epoch's end the source stops handing out requests.
                await monitor.driver.run(source, rate, left + 2 * seconds, until_empty=True)
                await asyncio.to_thread(waves.settle, source.handed)
        finally:
            task.cancel()
            monitor.sample(monitor.samples[-1] if monitor.samples else {})
    return time.monotonic() - monitor.started


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def summary(monitor: Monitor, seconds: float) -> dict[str, Any]:
    """The whole run: rates, latency percentiles, errors (every answer, refusals that were
    sent again included), how the requests ended (refused then delivered, never delivered),
    per shuffler."""
    stats = monitor.driver.stats
    latencies = sorted(stats.latencies)
    return {
        "seconds": round(seconds, 2),
        "offered": monitor.driver.sent,
        "accepted": stats.accepted,
        "offered_per_s": round(monitor.driver.sent / seconds, 1) if seconds else None,
        "accepted_per_s": round(stats.accepted / seconds, 1) if seconds else None,
        "p50_ms": _ms(loadgen.percentile(latencies, 0.50)),
        "p95_ms": _ms(loadgen.percentile(latencies, 0.95)),
        "p99_ms": _ms(loadgen.percentile(latencies, 0.99)),
        "errors": stats.errors,
        "given_up": stats.given_up,
        "refused_then_delivered": stats.refused_then_delivered,
        "never_delivered": stats.never_delivered,
        "recovered": stats.recovered,
        "retried": {str(k): v for k, v in sorted(stats.retried.items())},
        "behind_schedule": monitor.driver.behind,
        "per_shuffler": {
            monitor.shuffler_urls[i]: {str(k): v for k, v in sorted(c.items())}
            for i, c in sorted(stats.by_shuffler.items())
        },
        "statuses": {str(k): v for k, v in sorted(Counter(stats.statuses).items())},
    }
