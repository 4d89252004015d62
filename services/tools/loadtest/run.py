"""One load test from start to end: prepare, run with the live view, verify, report."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from services.tools import loadgen
from services.tools.loadtest import live, report, verify
from services.tools.loadtest.prepare import Plan, Prepared, prepare


@dataclass(frozen=True)
class Options:
    """Everything ``esa loadtest`` was asked to do."""

    plan: Plan
    rate: float | loadgen.Pace | None
    concurrency: int
    admin_token: str | None
    out: Path
    drain_timeout: float = 600.0
    live: bool = True
    local: Mapping[str, int] = field(default_factory=dict)


def channel_rows(
    options: Options, prepared: Prepared, accepted: Mapping[int, int]
) -> dict[str, dict[str, Any]]:
    """Per channel: its release over the run's epochs, the estimates checked, certified ε."""
    rows = {}
    for index, (cid, target) in enumerate(prepared.targets.items()):
        population = prepared.populations[cid]
        sent = accepted.get(index, 0)
        found = verify.release(options.plan.analyzer_url, cid, prepared.epochs[cid], population.k)
        row: dict[str, Any] = {"acknowledged": sent, "n": 0, "received": 0, "checked": []}
        row["inside"] = 0
        row |= {"central_eps": None, "delta": None, "method": None, "population": population.spec}
        if found is not None:
            checked = verify.check_estimates(target, population, found, sent)
            certificate = found["certificate"]
            eps = certificate["eps"]
            # Contributions received: the release's batch crowds (contributions per batch).
            crowds = [int(v) for v in (found.get("crowds") or {}).values()]
            row |= {
                "n": int(found["n"]),
                "received": sum(crowds) if crowds else int(found["n"]),
                "checked": checked,
                "inside": sum(1 for r in checked if r["lo"] <= r["expected"] <= r["hi"]),
                "central_eps": None if eps is None or not math.isfinite(eps) else float(eps),
                "delta": certificate["delta"],
                "method": certificate["method"],
                "local": found.get("local"),
            }
        rows[cid] = row
    return rows


def verification(
    options: Options,
    prepared: Prepared,
    before: dict[str, dict[str, float]],
    stats: loadgen.Stats,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Close, drain, then conservation and estimates (see :mod:`.verify`)."""
    assert options.admin_token is not None
    urls = prepared.shuffler_urls
    verify.close_epochs(urls, options.admin_token, prepared.epochs)
    say("epochs closed; waiting for every batch to reach the analyzer")
    drained = verify.drain(
        options.plan.analyzer_url, urls, options.admin_token, options.drain_timeout
    )
    after = verify.shuffler_state(urls, options.admin_token)
    channels = channel_rows(options, prepared, stats.accepted_by_tag)
    received = sum(r["received"] for r in channels.values())
    check = verify.conservation(before, after, stats.accepted, received)
    problems = verify.verdict(check, channels)
    totals = {k: v for k, v in check.items() if k != "per_shuffler"}
    return {
        "drain_seconds": round(drained, 1),
        "conservation": {"totals": totals, "per_shuffler": check["per_shuffler"]},
        "channels": channels,
        "problems": problems,
    }


def execute(options: Options, console: Console) -> dict[str, Any]:
    """The whole load test; returns the summary (``verification.problems`` empty: passed).

    Raises:
        loadgen.LoadError, PopulationError: nothing could be prepared.
        verify.VerifyError: verification could not complete.
    """
    plan = options.plan
    say = console.log
    prepared = prepare(plan, say)
    for skipped in prepared.skipped:
        say(f"left out: {skipped}")
    urls = prepared.shuffler_urls
    before = verify.shuffler_state(urls, options.admin_token) if options.admin_token else {}
    driver = loadgen.Driver(urls, max(1, options.concurrency // len(urls)))
    monitor = live.Monitor(driver, urls, options.local)
    epochs = {cid: t.channel.epoch_seconds for cid, t in prepared.targets.items()}
    source = live.ChannelSource(prepared.files, epochs)
    start = min(min(e) * epochs[c] for c, e in prepared.epochs.items())
    time.sleep(max(0.0, start - time.time()))
    say(f"run: {prepared.count:,} contributions prepared, {len(prepared.targets)} channels")
    seconds = asyncio.run(
        live.replay(monitor, source, options.rate, plan.duration, console, options.live)
    )
    run = live.summary(monitor, seconds)
    run["prepared_not_sent"] = prepared.count - driver.sent
    rate = run["accepted_per_s"]
    say(f"run finished: {run['accepted']:,} accepted in {seconds:.1f} s ({rate:,}/s)")
    summary: dict[str, Any] = {
        "analyzer_url": plan.analyzer_url,
        "devices": plan.devices,
        "channels": {cid: p.spec for cid, p in prepared.populations.items()},
        "skipped_channels": prepared.skipped,
        "preparation": {k: round(v, 1) for k, v in prepared.timings.items()},
        "run": run,
        "samples": report.public(monitor.samples),
    }
    if options.admin_token:
        summary["verification"] = verification(options, prepared, before, driver.stats, say)
    summary["report"] = str(options.out / "loadtest.html")
    report.write_json(options.out / "loadtest.json", summary)
    report.write_html(options.out / "loadtest.html", summary)
    return summary
