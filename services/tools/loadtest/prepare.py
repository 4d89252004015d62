"""The prepare phase: devices, their reports and every contribution of the run, ahead of time.

Each simulated device is a device in protocol terms (docs/protocol.md). Encoding and sealing run in
worker processes (:class:`services.tools.loadgen.SealerPool`) that write files of ready
requests, so the run phase only replays bytes: in Python, sealing a k-RAPPOR report costs more
CPU than a shuffler spends accepting it (docs/benchmarks.md, "Load test"). A longitudinal
channel's devices run their tree state (Erlingsson et al. 2019, Algorithm 1) through its periods
ahead of time; the outer envelopes are sealed during its own phase, one wave at a time
(:func:`series_waves`). The pool stays open until :meth:`Prepared.close`.

Details: docs/loadtest.md, "What a simulated device is" and "Phases".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.collection import TrustAnchors, VerifiedConfig
from common.mechanisms import ValueKind, build
from common.mechanisms import get as get_mechanism
from common.wire import ChannelConfig
from services.tools import loadgen, stopping
from services.tools.loadtest.population import Population, draw, draw_changes, is_changes

#: Request files by channel (or clock group), then by epoch.
Files = dict[str, dict[int, list[Path]]]
#: Outer seals per second assumed when planning a longitudinal phase (measured: ~2,500/s).
OUTER_SEALS_PER_S = 1500.0
#: Devices per channel whose contributions are sealed to measure the pool's pace before the
#: run's start is planned.
CALIBRATION = 1000
#: The run's planned start leaves this multiple of the measured sealing time.
PACE_MARGIN = 1.5
#: Longest a longitudinal channel's phase may take (d periods of epoch_seconds each) for it to
#: be driven; longer ones are left out (named in the log), or refused when named with --channel.
SERIES_MOST_SECONDS = 900


@dataclass(frozen=True)
class LoadPlan:
    """What to prepare: the deployment, the channels, the population, the run's length."""

    analyzer_url: str
    trust: TrustAnchors
    devices: int
    duration: float
    workdir: Path
    channels: tuple[str, ...] = ()
    populations: Mapping[str, str] = field(default_factory=dict)
    workers: int = 2
    enroll_concurrency: int = 32
    seed: int = 0
    #: Clock groups, (offset seconds, share of the devices): ``esa loadtest --clock-offset``.
    clock_offsets: tuple[tuple[float, float], ...] = ()


@dataclass
class Prepared:
    """The run's inputs: one target and population per channel, request files per epoch."""

    targets: dict[str, loadgen.Target]
    populations: dict[str, Population]
    files: dict[str, dict[int, list[Path]]]
    timings: dict[str, float]
    skipped: list[str]
    count: int
    #: Longitudinal channels, driven after the histogram channels, one phase each.
    series: dict[str, loadgen.Target] = field(default_factory=dict)
    #: The sealing workers, holding the longitudinal devices' reports (None once closed).
    pool: loadgen.SealerPool | None = None
    #: The requests of the devices whose clock is off (``--clock-offset``), by clock group
    #: (:func:`clock_name`), then by the epoch they are sent in (each names the epoch its own
    #: clock shows then); :attr:`files` holds the devices on true time.
    clocks: dict[str, dict[int, list[Path]]] = field(default_factory=dict)

    @property
    def parties(self) -> dict[str, str]:
        """The shufflers' ids and URLs (from their own descriptors)."""
        target = next(iter({**self.targets, **self.series}.values()))
        return {s.id: s.url for s in target.config.shufflers}

    @property
    def shuffler_urls(self) -> list[str]:
        """The deployment's shufflers (the same in every channel's config)."""
        return next(iter({**self.targets, **self.series}.values())).shuffler_urls

    def close(self, grace: float = loadgen.CLOSE_GRACE_SECONDS) -> None:
        """Stop the sealing workers (after ``grace`` seconds, even one in the middle of a
        step: :meth:`loadgen.SealerPool.close`)."""
        if self.pool is not None:
            self.pool.close(grace)
            self.pool = None

    @property
    def epochs(self) -> dict[str, list[int]]:
        """Per channel, the epochs that requests were sealed for."""
        return {cid: sorted(files) for cid, files in self.files.items()}


def clock_groups(
    offsets: tuple[tuple[float, float], ...],
) -> list[tuple[float, tuple[float, float]]]:
    """The devices' clock groups of ``offsets`` ((seconds, share) pairs): (offset seconds,
    the fractions of each worker's devices in it); the devices on true time first (offset 0,
    the share left), each group the same devices in every epoch.

    Raises:
        loadgen.LoadError: shares that leave no device on true time.
    """
    total = sum(share for _, share in offsets)
    if total >= 1:
        raise loadgen.LoadError(f"--clock-offset shares sum to {total:g}: leave some on time")
    groups: list[tuple[float, tuple[float, float]]] = [(0.0, (0.0, 1.0 - total))]
    start = 1.0 - total
    for offset, share in offsets:
        groups.append((offset, (start, start + share)))
        start += share
    return groups


def clock_name(channel_id: str, offset: float) -> str:
    """How a clock group of a channel is named in the run's summary (``pages@+600s``)."""
    return f"{channel_id}@{offset:+g}s"


def choose(
    config: VerifiedConfig, only: tuple[str, ...]
) -> tuple[dict[str, loadgen.Target], dict[str, loadgen.Target], list[str]]:
    """The channels to load (``only``, or every channel taking one category value or a state
    whose periods fit in :data:`SERIES_MOST_SECONDS`): histogram targets, longitudinal targets,
    and the names of those left out with why.

    Raises:
        loadgen.LoadError: a named channel is unknown or cannot be driven.
    """
    known = {c.id: c for c in config.channels}
    unknown = [c for c in only if c not in known]
    if unknown:
        raise loadgen.LoadError(
            f"unknown channel(s) {', '.join(unknown)}; the config has {', '.join(known)}"
        )
    targets: dict[str, loadgen.Target] = {}
    series: dict[str, loadgen.Target] = {}
    skipped: list[str] = []
    for channel in config.channels:
        if only and channel.id not in only:
            continue
        why = _left_out(channel)
        if why is not None:
            if only:
                raise loadgen.LoadError(f"channel {channel.id!r}: {why}")
            skipped.append(f"{channel.id} ({channel.mechanism}: {why})")
            continue
        kind = get_mechanism(channel.mechanism).value_kind
        into = series if kind is ValueKind.STATE else targets
        into[channel.id] = loadgen.Target(config, channel)
    if not targets and not series:
        raise loadgen.LoadError("no channel of the config takes category values or states")
    return targets, series, skipped


def _left_out(channel: ChannelConfig) -> str | None:
    """Why ``esa loadtest`` cannot drive ``channel`` (None: it can)."""
    mechanism = get_mechanism(channel.mechanism)
    if mechanism.value_kind is ValueKind.CATEGORY:
        return None
    if mechanism.value_kind is not ValueKind.STATE:
        return "does not take category values or states"
    periods = build(channel).domain_size()
    if periods * channel.epoch_seconds > SERIES_MOST_SECONDS:
        return (
            f"{periods} periods of {channel.epoch_seconds} s take longer than "
            f"{SERIES_MOST_SECONDS} s"
        )
    return None


def spec_for(plan: LoadPlan, channel_id: str, state: bool = False) -> str:
    """The channel's population spec (``*``: every channel's of its kind; default zipf, or
    changes for a longitudinal channel)."""
    default = plan.populations.get("*")
    if default is None or is_changes(default) != state:
        default = "changes" if state else "zipf"
    return plan.populations.get(channel_id, default)


def _populations(
    plan: LoadPlan, targets: dict[str, loadgen.Target], series: dict[str, loadgen.Target]
) -> dict[str, Population]:
    """Every channel's population (seeded: ``plan.seed`` + the channel's position)."""
    found = {}
    for i, (cid, t) in enumerate({**targets, **series}.items()):
        seed, spec = plan.seed + i, spec_for(plan, cid, state=cid in series)
        if cid in series:
            changes = int(t.channel.params.get("k", 1))
            found[cid] = draw_changes(spec, cid, domain(t), changes, plan.devices, seed)
        else:
            found[cid] = draw(spec, t.channel, domain(t), plan.devices, seed)
    return found


def domain(target: loadgen.Target) -> int:
    """The channel's number of values."""
    return build(target.channel).domain_size()


def run_epochs(target: loadgen.Target, start: float, seconds: float) -> list[int]:
    """The channel's epochs that a run of ``seconds`` from ``start`` touches."""
    return list(range(target.epoch(start), target.epoch(start + seconds) + 1))


def prepare(plan: LoadPlan, say: Callable[[str], None] = lambda _: None) -> Prepared:
    """Enroll ``plan.devices`` devices, seal their reports and their run's contributions (and
    every period's report of the longitudinal channels; the pool stays open for those).

    Raises:
        loadgen.LoadError: config refused, enrolment refused, a sealing worker failed.
        PopulationError: a population spec that does not fit its channel.
    """
    config = loadgen.fetch_config(plan.analyzer_url, plan.trust)
    targets, series, skipped = choose(config, plan.channels)
    pops = _populations(plan, targets, series)
    first = next(iter({**targets, **series}.values()))
    urls = first.shuffler_urls
    # The workers start (and import) while the devices enroll over HTTP.
    pool = loadgen.SealerPool(first, plan.workers)
    try:
        started = time.perf_counter()
        tokens = stopping.run(loadgen.enroll(urls, plan.devices, plan.enroll_concurrency))
        enrolled = time.perf_counter() - started
        rate = len(urls) * plan.devices / enrolled
        say(f"enrolled {plan.devices:,} devices at {len(urls)} shufflers ({rate:,.0f}/s)")
        pool.ready()
        sealed = cpu = 1e-9
        for cid in targets:
            timing = pool.add_devices(tokens, pops[cid].values.tolist(), cid)
            sealed, cpu = sealed + timing.seconds, cpu + timing.cpu_seconds
            say(f"{cid}: {timing.items:,} reports encoded and sealed ({timing.rate:,.0f}/s; "
                f"{timing.per_core:,.0f} per CPU second)")  # fmt: skip
        for cid in series:
            timing = pool.add_series(tokens, pops[cid].change_periods(), cid)
            say(
                f"{cid}: {plan.devices:,} devices ran their tree through {pops[cid].k} "
                f"periods: {timing.items:,} reports sealed ({timing.rate:,.0f}/s)"
            )
        files, clocks, outer = _seal_run(plan, targets, pool, say)
    except BaseException:  # a failure or a stop: no step of the workers' to wait for
        pool.close(0.0)
        raise
    timings = {
        "enrolments_per_s": len(urls) * plan.devices / enrolled,
        "reports_sealed_per_s": len(targets) * plan.devices / sealed,
        "reports_sealed_per_cpu_s": len(targets) * plan.devices / cpu,
        "contributions_sealed_per_s": outer[0] / outer[1],
        "contributions_sealed_per_cpu_s": outer[0] / outer[2],
        "workers": plan.workers,
    }
    return Prepared(
        targets=targets,
        populations=pops,
        files=files,
        timings=timings,
        skipped=skipped,
        count=outer[0],
        series=series,
        pool=pool,
        clocks=clocks,
    )


def _seal_run(
    plan: LoadPlan,
    targets: dict[str, loadgen.Target],
    pool: loadgen.SealerPool,
    say: Callable[[str], None],
) -> tuple[Files, Files, tuple[int, float, float]]:
    """Each channel's contributions for every epoch the run touches; (files of the devices
    on true time, files of the clock groups, (sealed, wall seconds, CPU seconds)).

    The envelopes name their epoch, so the run's start is planned before sealing: at the
    pace the pool just sealed a sample of each channel at (:func:`_pace`), with
    :data:`PACE_MARGIN`. When the sealing still ends after the planned start (the machine got
    busy), its files are deleted and it is done again for later epochs, with twice the
    margin."""
    if not targets:
        return {}, {}, (0, 1e-9, 1e-9)
    directory = plan.workdir / "requests"
    directory.mkdir(parents=True, exist_ok=True)
    per_device = _pace(plan, targets, pool, directory)
    needed = sum(
        (2 + math.ceil(plan.duration / t.channel.epoch_seconds)) * plan.devices * per_device[c]
        for c, t in targets.items()
    )
    margin = PACE_MARGIN
    for _ in range(3):
        start = time.time() + 2.0 + margin * needed
        files, clocks, sealed = _seal_epochs(plan, targets, pool, directory, start)
        if time.time() < start:
            say(f"sealed {sealed[0]:,} contributions ({sealed[0] / sealed[1]:,.0f}/s)")
            return files, clocks, sealed
        say("sealing took longer than planned: sealing again for later epochs")
        every = {**files, **clocks}.values()
        for path in (p for by_epoch in every for ps in by_epoch.values() for p in ps):
            path.unlink(missing_ok=True)
        margin *= 2
    raise loadgen.LoadError("could not seal the run's contributions ahead of its start")


def _pace(
    plan: LoadPlan, targets: dict[str, loadgen.Target], pool: loadgen.SealerPool, directory: Path
) -> dict[str, float]:
    """Wall seconds the pool takes per device's contribution(s) of each channel (a report of
    several routes is several requests), from a sample of up to :data:`CALIBRATION` devices
    per channel, sealed to files that are then deleted."""
    where = directory / "calibration"
    where.mkdir(exist_ok=True)
    count = min(plan.devices, CALIBRATION)
    found = {}
    for cid, target in targets.items():
        paths, timing = pool.seal_epoch(target.epoch(time.time()), count, where, channel=cid)
        for path in paths:
            path.unlink(missing_ok=True)
        found[cid] = timing.seconds / count
    where.rmdir()
    return found


def _seal_epochs(
    plan: LoadPlan,
    targets: dict[str, loadgen.Target],
    pool: loadgen.SealerPool,
    directory: Path,
    start: float,
) -> tuple[Files, Files, tuple[int, float, float]]:
    """Every channel's files for the epochs a run from ``start`` touches: of the devices on
    true time, and of each clock group (:func:`clock_groups`), whose devices seal the epoch
    their clock shows at the middle of the epoch they are sent in."""
    files: Files = {}
    written, seconds, cpu = 0, 0.0, 0.0
    for cid, target in targets.items():
        where = directory / cid
        where.mkdir(exist_ok=True)
        period = target.channel.epoch_seconds
        for group, (offset, among) in enumerate(clock_groups(plan.clock_offsets)):
            name = cid if offset == 0 else clock_name(cid, offset)
            count = sum(hi - lo for lo, hi in _ranges(pool, cid, among))
            files[name] = {}
            for epoch in run_epochs(target, start, plan.duration) if count else []:
                shown = target.epoch((epoch + 0.5) * period + offset)
                stem = f"sent-{epoch}-clock-{group}-epoch"
                paths, timing = pool.seal_epoch(
                    shown, count, where, channel=cid, among=among, stem=stem
                )
                files[name][epoch] = paths
                written, seconds = written + timing.items, seconds + timing.seconds
                cpu += timing.cpu_seconds
    clocks = {name: f for name, f in files.items() if name not in targets}
    mine = {cid: files[cid] for cid in targets}
    return mine, clocks, (written, max(seconds, 1e-9), max(cpu, 1e-9))


def _ranges(
    pool: loadgen.SealerPool, channel: str, among: tuple[float, float]
) -> list[tuple[int, int]]:
    """Each worker's device indices in the fractions ``among`` of its shard of ``channel``."""
    return [loadgen.clock_range(n, among) for n in pool.shards.get(channel, [])]


def series_waves(prepared: Prepared, channel_id: str, workdir: Path) -> loadgen.SeriesWaves:
    """The waves of a longitudinal channel's phase (:class:`loadgen.SeriesWaves`), whose
    outer envelopes are sealed one wave, one epoch, at a time.

    Raises:
        loadgen.LoadError: the pool is closed.
    """
    if prepared.pool is None:
        raise loadgen.LoadError("the sealing workers are closed")
    where = workdir / "requests" / channel_id
    channel = prepared.series[channel_id].channel
    return loadgen.SeriesWaves(prepared.pool, channel, where, OUTER_SEALS_PER_S)


def planned_rate(prepared: Prepared, duration: float) -> float:
    """The average rate that would send every prepared contribution in ``duration``."""
    return prepared.count / duration if duration > 0 else math.inf
