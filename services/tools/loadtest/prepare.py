"""The prepare phase: devices, their reports and every contribution of the run, ahead of time.

Each simulated device is a device in protocol terms (PROTOCOL.md): one client token enrolled
over HTTP at every shuffler, its own report per channel encoded with the channel's mechanism from
the OS CSPRNG and HPKE-sealed fragment by fragment to the analyzer, and per epoch of the run one
contribution with a fresh nonce sealed to the shuffler it routes to. Encoding and sealing run in
worker processes (:class:`services.tools.loadgen.SealerPool`) and write files of ready requests,
so that the run phase only replays bytes: in Python, sealing a k-RAPPOR report costs more CPU than
a shuffler spends accepting it (docs/benchmarks.md, "Load test"), so generating on the fly would
make the tool the bottleneck.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.collection import verify_config
from common.envelope import load_ed25519_public
from common.mechanisms import ValueKind
from common.mechanisms import get as get_mechanism
from common.wire import CollectionConfig
from services.tools import loadgen
from services.tools.loadtest.population import Population, draw

#: Outer seals per second assumed when planning when the run may start (measured: ~2,500/s).
OUTER_SEALS_PER_S = 1500.0


@dataclass(frozen=True)
class Plan:
    """What to prepare: the deployment, the channels, the population, the run's length."""

    analyzer_url: str
    trusted_key: str
    devices: int
    duration: float
    workdir: Path
    channels: tuple[str, ...] = ()
    populations: Mapping[str, str] = field(default_factory=dict)
    workers: int = 2
    enroll_concurrency: int = 32
    seed: int = 0


@dataclass
class Prepared:
    """The run's inputs: one target and population per channel, request files per epoch."""

    targets: dict[str, loadgen.Target]
    populations: dict[str, Population]
    files: dict[str, dict[int, list[Path]]]
    timings: dict[str, float]
    skipped: list[str]
    count: int

    @property
    def shuffler_urls(self) -> list[str]:
        """The deployment's shufflers (the same in every channel's config)."""
        return next(iter(self.targets.values())).shuffler_urls

    @property
    def epochs(self) -> dict[str, list[int]]:
        """Per channel, the epochs that requests were sealed for."""
        return {cid: sorted(files) for cid, files in self.files.items()}


def fetch_config(analyzer_url: str, trusted_key: str) -> CollectionConfig:
    """The collection config, verified against the pinned key as an app does.

    Raises:
        loadgen.LoadError: unreachable, mis-signed or expired.
    """
    try:
        document = httpx.get(analyzer_url + "/v1/config", timeout=30).raise_for_status().json()
        return verify_config(
            document, load_ed25519_public(base64.b64decode(trusted_key)), time.time()
        )
    except (httpx.HTTPError, ValueError) as error:
        raise loadgen.LoadError(f"collection config at {analyzer_url} refused: {error}") from error


def choose(
    config: CollectionConfig, only: tuple[str, ...]
) -> tuple[dict[str, loadgen.Target], list[str]]:
    """The channels to load (``only``, or every channel taking one category value) and the
    names of those left out with why.

    Raises:
        loadgen.LoadError: a named channel is unknown or does not take category values.
    """
    known = {c.id: c for c in config.channels}
    unknown = [c for c in only if c not in known]
    if unknown:
        raise loadgen.LoadError(
            f"unknown channel(s) {', '.join(unknown)}; the config has {', '.join(known)}"
        )
    targets, skipped = {}, []
    for channel in config.channels:
        if only and channel.id not in only:
            continue
        if get_mechanism(channel.mechanism).value_kind is not ValueKind.CATEGORY:
            if only:
                raise loadgen.LoadError(f"channel {channel.id!r} does not take category values")
            skipped.append(f"{channel.id} ({channel.mechanism}: not one value per report)")
            continue
        targets[channel.id] = loadgen.Target(config, channel)
    if not targets:
        raise loadgen.LoadError("no channel of the config takes category values")
    return targets, skipped


def spec_for(plan: Plan, channel_id: str) -> str:
    """The channel's population spec (``*``: every channel's; default zipf)."""
    return plan.populations.get(channel_id, plan.populations.get("*", "zipf"))


def domain(target: loadgen.Target) -> int:
    """The channel's number of values."""
    mechanism = get_mechanism(target.channel.mechanism)
    return int(mechanism.domain_size(mechanism.parse_params(target.channel.params)))


def run_epochs(target: loadgen.Target, start: float, seconds: float) -> list[int]:
    """The channel's epochs that a run of ``seconds`` from ``start`` touches."""
    return list(range(target.epoch(start), target.epoch(start + seconds) + 1))


def prepare(plan: Plan, say: Callable[[str], None] = lambda _: None) -> Prepared:
    """Enroll ``plan.devices`` devices, seal their reports and their run's contributions.

    Raises:
        loadgen.LoadError: config refused, enrolment refused, a sealing worker failed.
        PopulationError: a population spec that does not fit its channel.
    """
    config = fetch_config(plan.analyzer_url, plan.trusted_key)
    targets, skipped = choose(config, plan.channels)
    pops = {
        cid: draw(
            plan.populations.get(cid, "zipf"), t.channel, domain(t), plan.devices, plan.seed + i
        )
        for i, (cid, t) in enumerate(targets.items())
    }
    urls = next(iter(targets.values())).shuffler_urls
    # The workers start (and import) while the devices enroll over HTTP.
    with loadgen.SealerPool(next(iter(targets.values())), plan.workers) as pool:
        started = time.perf_counter()
        tokens = asyncio.run(loadgen.enroll(urls, plan.devices, plan.enroll_concurrency))
        enrolled = time.perf_counter() - started
        rate = len(urls) * plan.devices / enrolled
        say(f"enrolled {plan.devices:,} devices at {len(urls)} shufflers ({rate:,.0f}/s)")
        pool.ready()
        sealed = cpu = 0.0
        for cid in targets:
            timing = pool.add_devices(tokens, pops[cid].values.tolist(), cid)
            sealed, cpu = sealed + timing.seconds, cpu + timing.cpu_seconds
            say(
                f"{cid}: {timing.items:,} reports encoded and sealed ({timing.rate:,.0f}/s; "
                f"{timing.per_core:,.0f} per CPU second)"
            )
        files, outer = _seal_run(plan, targets, pool, say)
    return Prepared(
        targets,
        pops,
        files,
        {
            "enrolments_per_s": len(urls) * plan.devices / enrolled,
            "reports_sealed_per_s": len(targets) * plan.devices / sealed,
            "reports_sealed_per_cpu_s": len(targets) * plan.devices / cpu,
            "contributions_sealed_per_s": outer[0] / outer[1],
            "contributions_sealed_per_cpu_s": outer[0] / outer[2],
            "workers": plan.workers,
        },
        skipped,
        outer[0],
    )


def _seal_run(
    plan: Plan,
    targets: dict[str, loadgen.Target],
    pool: loadgen.SealerPool,
    say: Callable[[str], None],
) -> tuple[dict[str, dict[int, list[Path]]], tuple[int, float, float]]:
    """Each channel's contributions for every epoch the run touches; (files, (sealed, wall
    seconds, CPU seconds))."""
    directory = plan.workdir / "requests"
    directory.mkdir(parents=True, exist_ok=True)
    per_epoch = len(targets) * plan.devices
    ahead = 2.0 + per_epoch * (1 + plan.duration / 3600) / OUTER_SEALS_PER_S
    start = time.time() + ahead
    files: dict[str, dict[int, list[Path]]] = {}
    written, seconds, cpu = 0, 0.0, 0.0
    for cid, target in targets.items():
        files[cid] = {}
        for epoch in run_epochs(target, start, plan.duration):
            where = directory / cid
            where.mkdir(exist_ok=True)
            paths, timing = pool.seal_epoch(epoch, plan.devices, where, channel=cid)
            files[cid][epoch] = paths
            written, seconds = written + timing.items, seconds + timing.seconds
            cpu += timing.cpu_seconds
    say(f"sealed {written:,} contributions ({written / max(seconds, 1e-9):,.0f}/s)")
    return files, (written, max(seconds, 1e-9), max(cpu, 1e-9))


def planned_rate(prepared: Prepared, duration: float) -> float:
    """The average rate that would send every prepared contribution in ``duration``."""
    return prepared.count / duration if duration > 0 else math.inf
