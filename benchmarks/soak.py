"""Soak: a local deployment (1 analyzer + 3 shufflers, SQLite, as ``esa up`` starts it) under
~70% of its measured ingest for 10 minutes, an epoch closing every minute (issue 11).

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/soak.py --write`` (``--help``).

1. Start the deployment with one k-RAPPOR homepage-like channel (the catalogue's ``homepage``:
   k = 64, ε = 2, ~8 fragments per contribution) whose epoch is ``--epoch-seconds``.
2. Prepare devices (services/tools/loadgen/): each enrolls over HTTP at every shuffler,
   encodes and seals its report in a worker process, and gets one sealed contribution per epoch
   of the run, all ahead of time: sealing is slower than ingest in Python, so sealing during
   the run would measure the load generator.
3. Calibrate with a short burst, then phase 1: ``--ingest-seconds`` at the highest rate the
   three shufflers answer (accepted/s across them) = the measured ingest.
4. Phase 2: ``--minutes`` at ``--rate-fraction`` of it, starting on an epoch boundary; every
   epoch closes by time at each shuffler (its batch goes to the analyzer in parts).
5. Drain: wait until every shuffler has forwarded everything and the analyzer has opened every
   stored part; then check conservation: acknowledged (202) = received at the analyzer
   (``n_contributions`` of its accepted batches) + removed by randomized deletion + held +
   pending + purged (the shufflers' ledgers), with 0 lost and 0 counted twice.

Every 5 s it samples each service's RSS and open file descriptors (the process and its
children, /proc), the accepted rate, p50/p99 latency, errors by status, the shufflers' queues and
the analyzer's unopened parts. Writes ``<out>/soak.json`` and ``<out>/soak.png``; with
``--write`` also docs/figures/soak.png and the "10-minute soak" section of docs/benchmarks.md
(replacing it whole: the notes written there by hand after a run must be written again).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import re
import shutil
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import ROOT, add_write, machine, run_main, write_section
from rich.console import Console
from rich.live import Live
from rich.table import Table

from common.collection import TrustAnchors
from services.cli import launcher
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS

SECTION = "## 10-minute soak"
CHANNEL = "homepage"
SAMPLE_SECONDS = 5.0
#: Bearer token of the shufflers' (and analyzer's) /metrics in an ``esa up`` deployment.
METRICS_TOKEN = "development"
#: Extra devices per epoch over rate × epoch length (the pacer never needs more).
HEADROOM = 1.05
console = Console(stderr=True)


@dataclass
class Soak:
    """One run: the deployment, its load and everything sampled."""

    args: argparse.Namespace
    var: Path
    services: list[launcher.Service]
    target: loadgen.Target
    pool: loadgen.SealerPool
    driver: loadgen.Driver
    started: float = field(default_factory=time.time)
    phase: str = "prepare"
    samples: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def epoch_seconds(self) -> int:
        return self.target.channel.epoch_seconds

    def mark(self, phase: str) -> None:
        """Enter ``phase`` (its start time is kept for the plot)."""
        self.phase = phase
        self.phases.append({"phase": phase, "t": round(time.time() - self.started, 1)})


# --- the deployment -------------------------------------------------------------------------


def start_deployment(var: Path, epoch_seconds: int) -> list[launcher.Service]:
    """``esa up`` (launcher.prepare + start_all) with one homepage channel of this epoch."""
    homepage = next(c for c in DEFAULT_CHANNELS if c.id == CHANNEL)
    channel = homepage.model_copy(update={"epoch_seconds": epoch_seconds})
    base = launcher.free_base_port(4)
    specs = launcher.prepare(
        var, 3, base, channels=[channel], overrides=launcher.DEVELOPMENT_TOKENS
    )
    services = launcher.start_all(specs, var / "logs")
    try:  # as esa up: until the analyzer has every shuffler's signed descriptor
        launcher.wait_config(services[0], 60)
    except BaseException:
        launcher.stop(services)
        raise
    return services


async def scrape(url: str) -> dict[str, float]:
    """A service's /metrics as {name{labels}: value}."""
    connection = loadgen.HttpConnection(url, timeout=30)
    try:
        response = await connection.request(
            "GET", "/metrics", {"Authorization": f"Bearer {METRICS_TOKEN}"}
        )
    finally:
        connection.close()
    found = {}
    for line in response.body.decode().splitlines():
        match = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


async def queues(soak: Soak) -> dict[str, float]:
    """The shufflers' queues (summed) and the analyzer's unopened parts."""
    metrics = await asyncio.gather(*(scrape(s.url) for s in soak.services))
    analyzer, shufflers = metrics[0], metrics[1:]

    def total(name: str) -> float:
        return sum(m.get(name, 0.0) for m in shufflers)

    return {
        "analyzer_unopened": analyzer.get("esa_analyzer_parts_unopened", math.nan),
        "analyzer_parts_stored": analyzer.get("esa_analyzer_parts_stored_total", math.nan),
        "analyzer_parts_opened": analyzer.get("esa_analyzer_parts_opened_total", math.nan),
        "shuffler_pending": total('esa_shuffler_queue_depth{state="pending"}'),
        "shuffler_held": total('esa_shuffler_queue_depth{state="held"}'),
        "shuffler_unforwarded": total('esa_shuffler_queue_depth{state="in_batches_unforwarded"}'),
        "shuffler_received": total("esa_shuffler_contributions_received_total"),
    }


# --- sampling and display -------------------------------------------------------------------


async def sample_forever(soak: Soak, live: Live) -> None:
    """Every :data:`SAMPLE_SECONDS`: one sample, and the display."""
    last_time, last_accepted = time.monotonic(), 0
    while True:
        await asyncio.sleep(SAMPLE_SECONDS)
        now = time.monotonic()
        stats = soak.driver.stats
        window = stats.take_window()
        sample: dict[str, Any] = {
            "t": round(time.time() - soak.started, 1),
            "phase": soak.phase,
            "accepted": stats.accepted,
            "rate": round((stats.accepted - last_accepted) / (now - last_time), 1),
            "p50_ms": _ms(loadgen.percentile(window, 0.5)),
            "p99_ms": _ms(loadgen.percentile(window, 0.99)),
            "errors": stats.errors,
            "load_1min": round(os.getloadavg()[0], 2),
            "services": {},
        }
        last_time, last_accepted = now, stats.accepted
        for service in soak.services:
            usage = loadgen.process_usage(service.process.pid)
            sample["services"][service.name] = {
                "rss_mb": round(usage.rss_bytes / 2**20, 1),
                "fds": usage.fds,
                "processes": usage.processes,
            }
        try:
            sample.update(await queues(soak))
        except (TimeoutError, OSError, ValueError) as error:
            sample["scrape_error"] = type(error).__name__
        soak.samples.append(sample)
        live.update(display(soak, sample))


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1e3, 2)


def display(soak: Soak, sample: dict[str, Any]) -> Table:
    """The progress table."""
    table = Table(title=f"soak — {soak.phase} — {sample['t']:.0f} s", show_header=True)
    for column in ("service", "RSS MB", "fds", "procs"):
        table.add_column(column)
    for name, usage in sample["services"].items():
        table.add_row(name, f"{usage['rss_mb']:.0f}", str(usage["fds"]), str(usage["processes"]))
    table.add_section()
    table.add_row("accepted", f"{sample['accepted']:,}", f"{sample['rate']:,.0f}/s", "")
    table.add_row("p50 / p99 ms", f"{sample['p50_ms']}", f"{sample['p99_ms']}", "")
    table.add_row("errors", json.dumps(sample["errors"]), "", "")
    table.add_row(
        "queues",
        f"pending {sample.get('shuffler_pending', 0):,.0f}",
        f"unforwarded {sample.get('shuffler_unforwarded', 0):,.0f}",
        f"analyzer unopened {sample.get('analyzer_unopened', 0):,.0f}",
    )
    return table


# --- devices and epochs ---------------------------------------------------------------------


async def grow(soak: Soak, count: int) -> None:
    """Enroll ``count`` more devices at every shuffler and seal their reports."""
    if count <= 0:
        return
    start = time.perf_counter()
    tokens = await loadgen.enroll(soak.target.shuffler_urls, count, soak.args.concurrency // 3)
    enrolled = time.perf_counter() - start
    timing = await asyncio.to_thread(soak.pool.add_devices, tokens)
    rates = soak.notes.setdefault("preparation", [])
    rates.append(
        {
            "devices": count,
            "enrolments_per_s": round(3 * count / enrolled),
            "reports_sealed_per_s": round(timing.rate),
        }
    )
    console.log(
        f"{count:,} devices: enrolled {3 * count / enrolled:,.0f}/s, "
        f"reports sealed {timing.rate:,.0f}/s (pool {soak.pool.size:,})"
    )


async def seal_epochs(soak: Soak, epochs: list[int], count: int) -> dict[int, list[Path]]:
    """Each epoch's requests from ``count`` devices, written ahead of time."""
    directory = Path(soak.args.out) / "requests"
    directory.mkdir(parents=True, exist_ok=True)
    files, written, seconds = {}, 0, 0.0
    for epoch in epochs:
        paths, timing = await asyncio.to_thread(soak.pool.seal_epoch, epoch, count, directory)
        files[epoch] = paths
        written, seconds = written + timing.items, seconds + timing.seconds
    soak.notes.setdefault("outer_seals_per_s", []).append(round(written / seconds))
    console.log(
        f"sealed {written:,} contributions for epochs {epochs[0]}..{epochs[-1]} "
        f"({written / seconds:,.0f}/s)"
    )
    return files


def outer_rate(soak: Soak) -> float:
    """Contributions sealed per second so far (for planning how far ahead to start)."""
    rates = soak.notes.get("outer_seals_per_s", [])
    return float(min(rates)) if rates else 2_000.0


async def wait_for_epoch(soak: Soak, epoch: int, offset: float = 1.0) -> None:
    """Sleep until ``offset`` seconds into ``epoch``."""
    await asyncio.sleep(max(0.0, epoch * soak.epoch_seconds + offset - time.time()))


def cleanup(files: dict[int, list[Path]]) -> None:
    for paths in files.values():
        for path in paths:
            path.unlink(missing_ok=True)


# --- the phases -----------------------------------------------------------------------------


async def calibrate(soak: Soak) -> float:
    """A short burst from a small pool: the scale of the ingest rate (to size the pool)."""
    soak.mark("calibrate")
    await grow(soak, soak.args.calibration_devices)
    epoch = soak.target.epoch(time.time() + 20)  # this epoch if 20 s are left, else the next
    files = await seal_epochs(soak, [epoch], soak.pool.size)
    await wait_for_epoch(soak, epoch)
    seconds = await soak.driver.run(loadgen.EpochSource(files, soak.epoch_seconds), None, 30, True)
    cleanup(files)
    rate = soak.driver.stats.accepted / seconds
    console.log(f"calibration: {soak.driver.stats.accepted:,} accepted in {seconds:.1f} s")
    return rate


async def measure_ingest(soak: Soak, guess: float) -> dict[str, Any]:
    """Phase 1: as fast as the shufflers answer, from distinct devices of one fresh epoch."""
    args = soak.args
    await grow(soak, math.ceil(HEADROOM * guess * args.ingest_seconds) - soak.pool.size)
    ahead = soak.pool.size / outer_rate(soak) + 10
    epoch = soak.target.epoch(time.time() + ahead) + 1
    files = await seal_epochs(soak, [epoch], soak.pool.size)
    await wait_for_epoch(soak, epoch, 3.0)
    soak.mark("ingest")
    before, stats = soak.driver.stats.accepted, soak.driver.stats
    p_before = len(stats.latencies)
    source = loadgen.EpochSource(files, soak.epoch_seconds)
    seconds = await soak.driver.run(source, None, args.ingest_seconds, True)
    cleanup(files)
    accepted = stats.accepted - before
    latencies = stats.latencies[p_before:]
    return {
        "epoch": epoch,
        "seconds": round(seconds, 1),
        "accepted": accepted,
        "rate": round(accepted / seconds, 1),
        "p50_ms": round(loadgen.percentile(latencies, 0.5) * 1e3, 1),
        "p99_ms": round(loadgen.percentile(latencies, 0.99) * 1e3, 1),
        "pool_exhausted": source.next(time.time()) is None and seconds < args.ingest_seconds,
    }


async def soak_phase(soak: Soak, rate: float) -> dict[str, Any]:
    """Phase 2: ``rate`` contributions/s for whole epochs, starting on a boundary."""
    args, stats = soak.args, soak.driver.stats
    per_epoch = math.ceil(rate * soak.epoch_seconds * HEADROOM)
    await grow(soak, per_epoch - soak.pool.size)
    count = max(1, math.ceil(args.minutes * 60 / soak.epoch_seconds))
    ahead = count * per_epoch / outer_rate(soak) * 1.2 + 10
    first = soak.target.epoch(time.time() + ahead) + 1
    epochs = list(range(first, first + count))
    files = await seal_epochs(soak, epochs, per_epoch)
    await wait_for_epoch(soak, first, 0.0)
    soak.mark("soak")
    before, p_before, errors_before = stats.accepted, len(stats.latencies), dict(stats.errors)
    source = loadgen.EpochSource(files, soak.epoch_seconds)
    seconds = await soak.driver.run(source, rate, count * soak.epoch_seconds - 0.5)
    cleanup(files)
    latencies = stats.latencies[p_before:]
    errors = {k: v - errors_before.get(k, 0) for k, v in stats.errors.items()}
    return {
        "epochs": [first, first + count - 1],
        "target_rate": round(rate, 1),
        "seconds": round(seconds, 1),
        "accepted": stats.accepted - before,
        "rate": round((stats.accepted - before) / seconds, 1),
        "p50_ms": round(loadgen.percentile(latencies, 0.5) * 1e3, 1),
        "p99_ms": round(loadgen.percentile(latencies, 0.99) * 1e3, 1),
        "errors": {k: v for k, v in errors.items() if v},
        "prepared_not_needed": source.skipped,
        "behind_schedule": soak.driver.behind,
    }


async def drain(soak: Soak, last_epoch: int) -> dict[str, float | None]:
    """Wait until the last epoch closed and every shuffler forwarded everything (delivery),
    then until the analyzer opened every stored part (opening); seconds of each, from the end
    of the soak, None if ``--drain-timeout`` passed first."""
    soak.mark("drain")
    ended = (last_epoch + 1) * soak.epoch_seconds
    await wait_for_epoch(soak, last_epoch + 1, 5.0)
    found: dict[str, float | None] = {"delivery": None, "opening": None}
    while time.time() - ended < soak.args.drain_timeout:
        state = await queues(soak)
        if state["shuffler_pending"] == 0 and state["shuffler_unforwarded"] == 0:
            found["delivery"] = found["delivery"] or round(time.time() - ended, 1)
            if state["analyzer_unopened"] == 0:
                found["opening"] = round(time.time() - ended, 1)
                return found
        await asyncio.sleep(SAMPLE_SECONDS)
    console.log(f"drain not finished after {soak.args.drain_timeout:.0f} s: {found}")
    return found


# --- conservation ---------------------------------------------------------------------------


def read_sql(path: Path, query: str) -> list[tuple[Any, ...]]:
    """Rows of a read-only query on a service's SQLite file (the service may be running)."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60) as conn:
        return list(conn.execute(query).fetchall())


def shuffler_ledger(path: Path) -> dict[str, Any]:
    """Where a shuffler's acknowledged contributions went (its tables, as ``ledger()``)."""

    def one(query: str) -> int:
        return int(read_sql(path, query)[0][0] or 0)

    return {
        "pending": one(
            "SELECT count(*) FROM contributions c WHERE held_part IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM groups g WHERE g.channel_id = c.channel_id "
            "AND g.crowd_id = c.crowd_id AND g.epoch = c.epoch)"
        ),
        "held": one("SELECT count(*) FROM contributions WHERE held_part IS NOT NULL"),
        "batched": one("SELECT sum(n_contributions) FROM batches"),
        "forwarded": one("SELECT sum(n_contributions) FROM batches WHERE status = 'forwarded'"),
        "deleted": one("SELECT sum(deleted) FROM groups"),
        "purged": one("SELECT sum(contributions) FROM purges"),
        "batches": {
            row[0]: (int(row[1]), int(row[2]))
            for row in read_sql(path, "SELECT batch_id, n_contributions, epoch FROM batches")
        },
    }


async def conservation(soak: Soak) -> dict[str, Any]:
    """Acknowledged = received at the analyzer + deleted + held + pending + purged."""
    ledgers = {
        s.name: shuffler_ledger(soak.var / s.name / "shuffler.db") for s in soak.services[1:]
    }
    receipts = read_sql(
        soak.var / "analyzer" / "analyzer.db",
        f"SELECT batch_id, n_contributions, epoch FROM receipts WHERE channel_id = '{CHANNEL}'",
    )
    stored = read_sql(
        soak.var / "analyzer" / "analyzer.db",
        "SELECT batch_id, max(n_contributions) FROM batch_parts GROUP BY batch_id "
        "HAVING count(*) = max(parts)",
    )
    parts = dict(
        read_sql(
            soak.var / "analyzer" / "analyzer.db",
            "SELECT status, count(*) FROM batch_parts GROUP BY status",
        )
    )
    sent = {b: n for ledger in ledgers.values() for b, (n, _) in ledger["batches"].items()}
    received = sum(int(n) for _, n in stored)
    accumulated = sum(int(n) for _, n, _ in receipts)
    mismatched = [b for b, n in stored if sent.get(b) != n]
    epochs = sorted({int(e) for _, _, e in receipts})
    estimate = await analyzer_n(soak, epochs)
    totals = {
        k: sum(ledger[k] for ledger in ledgers.values())
        for k in ("pending", "held", "batched", "forwarded", "deleted", "purged")
    }
    acknowledged = soak.driver.stats.accepted
    accounted = received + totals["deleted"] + totals["held"] + totals["pending"] + totals["purged"]
    return {
        "acknowledged_202": acknowledged,
        "shufflers_received_counter": int((await queues(soak))["shuffler_received"]),
        **totals,
        "received_at_analyzer": received,
        "accumulated_at_analyzer": accumulated,
        "analyzer_batches": len(stored),
        "analyzer_batches_accumulated": len(receipts),
        "shuffler_batches": len(sent),
        "batches_missing_at_analyzer": len(set(sent) - {b for b, _ in stored}),
        "batches_unknown_or_mismatched": len(mismatched),
        "analyzer_parts_by_status": parts,
        "estimate_n": estimate,
        "lost": acknowledged - accounted,
        "counted_twice": (estimate - accumulated) if estimate is not None else None,
        "per_shuffler": {
            name: {k: v for k, v in one.items() if k != "batches"} for name, one in ledgers.items()
        },
    }


async def analyzer_n(soak: Soak, epochs: list[int]) -> int | None:
    """``n`` of the analyzer's estimate over every epoch received (counted once each)."""
    if not epochs:
        return None
    connection = loadgen.HttpConnection(soak.services[0].url, timeout=120)
    try:
        response = await connection.request(
            "GET",
            f"/v1/channels/{CHANNEL}/estimate?epoch_from={epochs[0]}&epoch_to={epochs[-1]}",
            {},
        )
    finally:
        connection.close()
    if response.status != 200:
        console.log(f"estimate: {response.status} {response.body[:300]!r}")
        return None
    return int(json.loads(response.body)["n"])


# --- results --------------------------------------------------------------------------------


def service_curves(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per service: RSS and fds when the soak started, when it ended, after the drain, and the
    peak from the soak's start on."""
    soaked = [s for s in samples if s["phase"] in ("soak", "drain")]
    during = [s for s in samples if s["phase"] == "soak"]
    if not soaked or not during:
        return {}
    found = {}
    for name in soaked[0]["services"]:
        rss = [s["services"][name]["rss_mb"] for s in soaked]
        fds = [s["services"][name]["fds"] for s in soaked]
        found[name] = {
            "rss_mb_start": during[0]["services"][name]["rss_mb"],
            "rss_mb_end_of_soak": during[-1]["services"][name]["rss_mb"],
            "rss_mb_after_drain": rss[-1],
            "rss_mb_peak": max(rss),
            "fds_start": during[0]["services"][name]["fds"],
            "fds_end_of_soak": during[-1]["services"][name]["fds"],
            "fds_after_drain": fds[-1],
            "fds_peak": max(fds),
        }
    return found


def mean_load(samples: list[dict[str, Any]]) -> float | None:
    """Mean 1-minute load average over the soak phase's samples (other work on the machine)."""
    loads = [s["load_1min"] for s in samples if s["phase"] == "soak"]
    return round(sum(loads) / len(loads), 2) if loads else None


def plot(samples: list[dict[str, Any]], phases: list[dict[str, Any]], path: Path) -> None:
    """RSS, fds, accepted rate + p99 and the analyzer's backlog over time, phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    for name in samples[0]["services"]:
        axes[0].plot(t, [s["services"][name]["rss_mb"] for s in samples], label=name)
        axes[1].plot(t, [s["services"][name]["fds"] for s in samples], label=name)
    axes[0].set_ylabel("RSS (MiB, with children)")
    axes[1].set_ylabel("open fds (with children)")
    axes[2].plot(t, [s["rate"] for s in samples], color="tab:blue", label="accepted/s")
    axes[2].set_ylabel("accepted / s", color="tab:blue")
    p99 = axes[2].twinx()
    p99.plot(
        t,
        [math.nan if s["p99_ms"] is None else s["p99_ms"] for s in samples],
        color="tab:red",
        label="p99 ms",
    )
    p99.set_ylabel("p99 latency (ms)", color="tab:red")
    axes[3].plot(
        t, [s.get("analyzer_unopened", math.nan) for s in samples], label="analyzer: parts unopened"
    )
    axes[3].plot(
        t,
        [s.get("shuffler_pending", math.nan) / 1000 for s in samples],
        label="shufflers: pending contributions (thousands)",
    )
    axes[3].set_ylabel("backlog")
    axes[3].set_xlabel("minutes since the deployment started")
    for ax in (axes[0], axes[1], axes[3]):
        ax.legend(loc="upper left", fontsize=8)
    edges = [*phases, {"phase": "end", "t": samples[-1]["t"]}]
    colours = {"ingest": "tab:orange", "soak": "tab:green", "drain": "tab:grey"}
    for start, end in itertools.pairwise(edges):
        if start["phase"] in colours:
            for ax in axes:
                ax.axvspan(
                    start["t"] / 60, end["t"] / 60, alpha=0.08, color=colours[start["phase"]]
                )
            axes[0].text(
                start["t"] / 60,
                1.01,
                start["phase"],
                fontsize=8,
                transform=axes[0].get_xaxis_transform(),
            )
    fig.suptitle("Soak: 1 analyzer + 3 shufflers (SQLite), k-RAPPOR homepage channel")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(summary: dict[str, Any]) -> str:
    """The "10-minute soak" section of docs/benchmarks.md."""
    ingest, phase, check = summary["ingest"], summary["soak"], summary["conservation"]
    prep, drain = summary["preparation"], summary["drain_seconds"]
    errors = ", ".join(f"{k}: {v:,}" for k, v in phase["errors"].items()) or "none"
    head = (
        "| service (with child processes) | RSS MiB start | end of soak | after drain | peak "
        "| fds start | end of soak | after drain | peak |"
    )
    services = [head, "|---|---|---|---|---|---|---|---|---|"] + [
        f"| {name} | {c['rss_mb_start']:.0f} | {c['rss_mb_end_of_soak']:.0f} | "
        f"{c['rss_mb_after_drain']:.0f} | {c['rss_mb_peak']:.0f} | {c['fds_start']} | "
        f"{c['fds_end_of_soak']} | {c['fds_after_drain']} | {c['fds_peak']} |"
        for name, c in summary["services"].items()
    ]
    measures = [
        "| measure | value |",
        "|---|---|",
        f"| ingest, phase 1 (as fast as answered, {ingest['seconds']} s) | "
        f"**{ingest['rate']:,.0f} accepted/s** (p50 {ingest['p50_ms']} ms, "
        f"p99 {ingest['p99_ms']} ms) |",
        f"| soak rate (target {summary['rate_fraction']:.0%} = {phase['target_rate']:,.0f}/s) "
        f"| **{phase['rate']:,.0f}/s** over {phase['seconds'] / 60:.1f} min, epochs "
        f"{phase['epochs'][0]}..{phase['epochs'][1]} |",
        f"| soak latency | p50 **{phase['p50_ms']} ms**, p99 **{phase['p99_ms']} ms** |",
        f"| soak errors (non-202 answers, transport) | {errors} |",
        f"| contributions accepted in the soak | {phase['accepted']:,} |",
        "| after the last epoch: every batch forwarded / every part opened at the analyzer | "
        f"{_seconds(drain['delivery'])} / {_seconds(drain['opening'])} |",
        f"| mean 1-minute load average during the soak (2 cores) | "
        f"{summary['load_1min_during_soak']} |",
    ]
    return f"""Command: `{summary["command"]}`.
Machine: {summary["machine"]}, 24 GiB RAM; the services, the load generator and other
sessions' work share the 2 cores.

One `esa up`-style deployment (launcher: 1 analyzer + 3 shufflers, SQLite, default settings)
with the catalogue's `homepage` channel (k-RAPPOR, k = 64, ε = 2: ~8 sealed fragments,
~0.8 KB per contribution) and a {summary["epoch_seconds"]}-second epoch. Load
(services/tools/loadgen/): every device enrolls over HTTP at each shuffler, encodes its value
(Zipf over the 64 pages) with the OS CSPRNG and seals every fragment to the analyzer in worker
processes, once (a memoized report), and for each epoch gets a new contribution (new nonce, that
epoch) sealed to a shuffler picked uniformly, all written ahead of the run: reports sealed at
{prep["reports_sealed_per_s"]:,}/s and contributions at {prep["outer_seals_per_s"]:,}/s on the 2
cores, below the ingest rate, so sealing during the run would have measured the generator.
Replay: {summary["connections"]} keep-alive HTTP/1.1 connections, paced, 429 + Retry-After
honoured; {prep["devices"]:,} devices.

{chr(10).join(measures)}

{chr(10).join(services)}

Conservation (whole run, calibration and phase 1 included): acknowledged (202)
**{check["acknowledged_202"]:,}** (shufflers' counter {check["shufflers_received_counter"]:,}) =
received at the analyzer {check["received_at_analyzer"]:,} (n of {check["analyzer_batches"]}
complete batches stored) + removed by randomized deletion {check["deleted"]:,} + held
{check["held"]:,} + pending {check["pending"]:,} + purged {check["purged"]:,}: **lost
{check["lost"]:,}**. Accumulated {check["accumulated_at_analyzer"]:,}
({check["analyzer_batches_accumulated"]} batches); the estimate's n over those epochs is
{check["estimate_n"]}: **counted twice {check["counted_twice"]}**. Shuffler batches
{check["shuffler_batches"]}, missing at the analyzer {check["batches_missing_at_analyzer"]},
mismatched {check["batches_unknown_or_mismatched"]}.

![soak](figures/soak.png)
"""


def _seconds(value: float | None) -> str:
    return "not finished" if value is None else f"{value:.0f} s"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole soak; returns the summary (samples included)."""
    out = Path(args.out)
    var = out / "var"
    shutil.rmtree(var, ignore_errors=True)
    services = start_deployment(var, args.epoch_seconds)
    try:
        trust = TrustAnchors.load(var / launcher.TRUST_FILE)
        target = loadgen.fetch_target(services[0].url, trust, CHANNEL)
        with loadgen.SealerPool(target, args.workers) as pool:
            driver = loadgen.Driver(target.shuffler_urls, max(1, args.concurrency // 3))
            soak = Soak(
                args=args, var=var, services=services, target=target, pool=pool, driver=driver
            )
            with Live(Table(title="soak: starting"), console=console, refresh_per_second=1) as live:
                sampler = asyncio.create_task(sample_forever(soak, live))
                try:
                    return await phases(soak)
                finally:
                    sampler.cancel()
    finally:
        launcher.stop(services)


async def phases(soak: Soak) -> dict[str, Any]:
    """Calibrate, measure ingest, soak, drain, check; the summary."""
    args = soak.args
    guess = await calibrate(soak)
    ingest = await measure_ingest(soak, guess)
    console.log(f"ingest: {ingest}")
    phase = await soak_phase(soak, args.rate_fraction * ingest["rate"])
    console.log(f"soak: {phase}")
    soak.pool.close()
    drained = await drain(soak, phase["epochs"][1])
    await asyncio.sleep(SAMPLE_SECONDS + 1)  # one sample after the drain
    check = await conservation(soak)
    console.log(
        f"conservation: {json.dumps({k: v for k, v in check.items() if k != 'per_shuffler'})}"
    )
    prep = soak.notes["preparation"]
    return {
        "command": "flock /tmp/esa-bench.lock .venv/bin/python benchmarks/soak.py "
        + " ".join(sys.argv[1:]),
        "machine": machine(pinned=False),
        "epoch_seconds": soak.epoch_seconds,
        "rate_fraction": args.rate_fraction,
        "connections": 3 * soak.driver.concurrency,
        "preparation": {
            "devices": soak.pool.size,
            "enrolments_per_s": min(p["enrolments_per_s"] for p in prep),
            "reports_sealed_per_s": min(p["reports_sealed_per_s"] for p in prep),
            "outer_seals_per_s": min(soak.notes["outer_seals_per_s"]),
        },
        "ingest": ingest,
        "soak": phase,
        "drain_seconds": drained,
        "load_1min_during_soak": mean_load(soak.samples),
        "conservation": check,
        "services": service_curves(soak.samples),
        "phases": soak.phases,
        "samples": soak.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=10, help="soak length (default 10)")
    parser.add_argument(
        "--rate-fraction",
        type=float,
        default=0.7,
        help="soak rate as a fraction of the measured ingest (default 0.7)",
    )
    parser.add_argument(
        "--epoch-seconds",
        type=int,
        default=60,
        help="the channel's epoch: one closes this often (default 60)",
    )
    parser.add_argument(
        "--out",
        default="/tmp/esa-soak",
        help="folder for soak.json, soak.png, the deployment and the requests",
    )
    parser.add_argument(
        "--ingest-seconds",
        type=float,
        default=30,
        help="phase 1 length at the highest rate (default 30)",
    )
    parser.add_argument(
        "--calibration-devices",
        type=int,
        default=6000,
        help="devices of the calibration burst that sizes the pool",
    )
    parser.add_argument("--workers", type=int, default=2, help="sealing processes")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=144,
        help="keep-alive connections in all (split over the 3 shufflers)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=3600,
        help="most seconds to wait for delivery and opening after the soak",
    )
    add_write(parser, also="; it also copies soak.png to docs/figures/soak.png")
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    out = Path(args.out)
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    plot_soak = out / "soak.png"
    plot(summary["samples"], summary["phases"], plot_soak)
    if args.write:
        shutil.copyfile(plot_soak, ROOT / "docs" / "figures" / "soak.png")
    write_section(SECTION, section(summary), args.write)
    console.print_json(json.dumps({k: v for k, v in summary.items() if k != "samples"}))


if __name__ == "__main__":
    run_main(main)
