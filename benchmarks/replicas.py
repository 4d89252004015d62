"""Replicas and analyzer workers (issue 17): accepted contributions/s through HAProxy with 1 vs 2
replicas per shuffler, and fragments opened/s of one stored epoch with 1 vs 2 analyzer workers.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/replicas.py`` (``--help``).
PostgreSQL at ``ESA_BENCH_POSTGRES`` (default ``postgres@127.0.0.1:5432``, trust auth); the
script creates and drops its own databases (``esa_rb_*``, prefix ``ESA_BENCH_DB_PREFIX``).

``--shufflers`` trust domains (default 3, the pipeline's; all share the 2 cores, so a second
replica per domain doubles the shuffler processes on them; with 1, the second replica has the
machine's spare core, as on a trust domain's own host).

1. Devices (services/tools/loadgen/): ``--devices`` devices enroll over HTTP at each
   shuffler, encode and seal a k-RAPPOR ``homepage`` report (~31 fragments) in worker
   processes, and one sealed contribution each is written to disk ahead of the run. Client
   tokens are HMACs under each shuffler's secret (kept under the var folder), so the very same
   requests (same bodies, same sizes) are replayed in every round against fresh databases.
2. Ingest rounds: ``--warmup`` rounds at R = 1 that are not counted (the first round after
   sealing ran slower), then R in the balanced order 1, 2, 2, 1, 1, 2, 2, 1, ... (``--rounds``
   pairs; each pair of pairs is ABBA, so a load that drifts linearly over the run weighs on
   both layouts alike). Each round: fresh databases, ``esa up``'s scaled layout
   (launcher.start_scaled: R processes per shuffler, 1 analyzer, HAProxy in front even for
   R = 1), then the loadgen Driver sends every request as fast as the shufflers answer over
   ``--concurrency`` keep-alive connections: the same offered load in every round. Checked
   after each round: every request answered 202 and each shuffler's database holds exactly
   its accepted contributions. Compared: the pooled rate of each layout (its accepted
   contributions over its seconds, all rounds), and the ratio within each adjacent pair.
   Also the services' CPU (``/proc``: the shuffler and analyzer processes, HAProxy, their
   PostgreSQL backends) per accepted contribution, which other work on the machine disturbs
   far less than the rate, and the cores they used; and the transactions committed in each
   shuffler's database (``pg_stat_database.xact_commit`` once the round's processes exited:
   group commits, background polls, start-up). ``--opening-rounds 0`` stops after the ingest
   rounds and prints their numbers (a quick look, no markdown).
3. A stored epoch: after the last round the analyzer is stopped, the epoch is closed at every
   shuffler (admin close through HAProxy), and once every group is evaluated and its batch
   parts are built, the shuffler databases are copied (``CREATE DATABASE ... TEMPLATE``) with
   the parts held back (``next_attempt_at`` far ahead).
4. Opening rounds, W in the same balanced order 1, 2, 2, 1, ...: the shuffler databases
   restored from the copy, a fresh analyzer database, R = 1 and W analyzer processes behind
   HAProxy; once all are ready the parts are released (``next_attempt_at = 0``) and the time
   until the analyzer has stored and opened every part is measured. Checked: every part
   opened, one receipt per batch, contributions received = contributions the shufflers
   released.

Prints a markdown section and writes it to ``<out>/replicas.md`` (appended to
docs/benchmarks.md by hand) and the numbers to ``<out>/replicas.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from sqlalchemy import func, select, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import machine, run_main
from rich.console import Console

from analyzer import tables as analyzer_tables
from common.collection import TrustAnchors
from common.wire import MAX_EPOCH_SECONDS
from runtime import db
from services.cli import launcher
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS
from shuffler import tables
from shuffler.store_backends import make_store

POSTGRES = os.environ.get("ESA_BENCH_POSTGRES", "postgres@127.0.0.1:5432")
PREFIX = os.environ.get("ESA_BENCH_DB_PREFIX", "esa_rb")
#: Trust domains (``--shufflers``; :func:`use_shufflers`) and every service's database name.
SHUFFLERS = 3
SERVICES = ["analyzer", *(f"shuffler_{i}" for i in range(1, SHUFFLERS + 1))]
CHANNEL_ID = "homepage"
#: One epoch for the whole run (the requests are sealed for it once).
EPOCH_SECONDS = MAX_EPOCH_SECONDS
ADMIN = {"Authorization": "Bearer development"}
#: Parts held back in the copied shuffler databases until the analyzer workers are ready.
HELD_BACK = 1e12
PART_FRAGMENTS = 10_000
OVERRIDES = {
    "ESA_SHUFFLER_ENROLL_PER_MINUTE": "6000000",
    "ESA_ANALYZER_OPENING_POLL_SECONDS": "0.2",
    # Parts of 10,000 fragments (default 50,000): W workers open different parts at once.
    "ESA_SHUFFLER_PART_FRAGMENTS": str(PART_FRAGMENTS),
    **launcher.DEVELOPMENT_TOKENS,
}
console = Console(stderr=True)


def use_shufflers(count: int) -> None:
    """Run with ``count`` trust domains (the default 3 share the 2 cores; 1 measures a replica
    against the machine's spare core, as on a trust domain's own host)."""
    global SHUFFLERS, SERVICES
    SHUFFLERS = count
    SERVICES = ["analyzer", *(f"shuffler_{i}" for i in range(1, count + 1))]


def template() -> str:
    """The ``--database-url-template`` of every deployment here."""
    return f"postgresql+psycopg://{POSTGRES}/{PREFIX}_{{service}}"


def admin(*statements: str) -> None:
    """Run statements on the server's ``postgres`` database (autocommit: CREATE DATABASE)."""
    user, hostport = POSTGRES.split("@")
    host, port = hostport.split(":")
    with psycopg.connect(host=host, port=port, user=user, dbname="postgres", autocommit=True) as c:
        for statement in statements:
            c.execute(statement.encode())


def fresh_databases(from_snapshot: bool = False) -> None:
    """Drop and create every service's database (shufflers' from the stored-epoch copy)."""
    for service in SERVICES:
        name = f"{PREFIX}_{service}"
        source = f" TEMPLATE {PREFIX}_snap_{service}" if from_snapshot else ""
        if service == "analyzer":
            source = ""
        admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", f"CREATE DATABASE {name}{source}")


def drop_all() -> None:
    for service in SERVICES:
        admin(
            f"DROP DATABASE IF EXISTS {PREFIX}_{service} WITH (FORCE)",
            f"DROP DATABASE IF EXISTS {PREFIX}_snap_{service} WITH (FORCE)",
        )


def engine_of(service: str) -> Any:
    return db.make_engine(template().replace("{service}", service))


def deploy(var: Path, replicas: int, workers: int) -> tuple[list[launcher.Service], int]:
    """The scaled layout of ``esa up`` (HAProxy in front, also for 1 x 1); its base port."""
    base = launcher.free_base_port(launcher.scaled_ports(SHUFFLERS, replicas, workers) + 2)
    channel = next(c for c in DEFAULT_CHANNELS if c.id == CHANNEL_ID)
    channel = channel.model_copy(update={"epoch_seconds": EPOCH_SECONDS})
    specs = launcher.prepare(
        var,
        SHUFFLERS,
        base,
        database_template=template(),
        channels=[channel],
        overrides=OVERRIDES,
    )
    services = launcher.start_scaled(var, specs, replicas, workers, base, 120)
    try:  # as esa up: until the analyzer has every shuffler's signed descriptor
        launcher.wait_config(next(s for s in services if s.name == "haproxy:analyzer"), 120)
    except BaseException:
        launcher.stop(services)
        raise
    return services, base


def fronts(base: int) -> list[str]:
    return [f"http://127.0.0.1:{base + i}" for i in range(1, SHUFFLERS + 1)]


async def prepare_load(var: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Enroll and seal ``--devices`` devices' contributions for the run's epoch, once."""
    fresh_databases()
    services, base = deploy(var, 1, 1)
    try:
        trust = TrustAnchors.load(var / launcher.TRUST_FILE)
        target = loadgen.fetch_target(f"http://127.0.0.1:{base}", trust, CHANNEL_ID)
        with loadgen.SealerPool(target, args.workers) as pool:
            pool.ready()
            start = time.perf_counter()
            tokens = await loadgen.enroll(fronts(base), args.devices, args.concurrency // SHUFFLERS)
            enrolled = time.perf_counter() - start
            reports = await asyncio.to_thread(pool.add_devices, tokens)
            epoch = target.epoch(time.time())
            directory = out / "requests"
            directory.mkdir(parents=True, exist_ok=True)
            files, outer = await asyncio.to_thread(pool.seal_epoch, epoch, args.devices, directory)
    finally:
        launcher.stop(services)
    body = sum(p.stat().st_size for p in files) / args.devices
    console.log(
        f"{args.devices:,} devices: enrolled {SHUFFLERS * args.devices / enrolled:,.0f}/s, "
        f"reports sealed {reports.rate:,.0f}/s, contributions sealed {outer.rate:,.0f}/s"
    )
    return {"epoch": epoch, "files": files, "request_bytes": body}


def stored_contributions() -> dict[str, int]:
    """Contributions in each shuffler's database."""
    counts = {}
    for service in SERVICES[1:]:
        engine = engine_of(service)
        try:
            with engine.connect() as conn:
                query = select(func.count()).select_from(tables.contributions)
                counts[service] = int(conn.execute(query).scalar_one())
        finally:
            engine.dispose()
    return counts


def transactions() -> dict[str, int]:
    """Transactions committed in each shuffler's database so far (``pg_stat_database``; exact
    once the services' backends have exited, which flush their counts)."""
    names = [f"{PREFIX}_{service}" for service in SERVICES[1:]]
    user, hostport = POSTGRES.split("@")
    host, port = hostport.split(":")
    with psycopg.connect(host=host, port=port, user=user, dbname="postgres") as c:
        rows = c.execute(
            "SELECT datname, xact_commit FROM pg_stat_database WHERE datname = ANY(%s)", (names,)
        ).fetchall()
    return {str(name).removeprefix(f"{PREFIX}_"): int(count) for name, count in rows}


def cpu_seconds(pids: set[int]) -> dict[int, float]:
    """CPU seconds (user + system) so far, by pid, of ``pids`` and of every PostgreSQL backend
    serving this script's databases (process title ``postgres: ... <prefix>_<service> ...``)."""
    tick = os.sysconf("SC_CLK_TCK")
    marker = f" {PREFIX}_".encode()
    times = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(entry.name) not in pids and marker not in (entry / "cmdline").read_bytes():
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    return times


async def ingest_round(
    var: Path, replicas: int, load: dict[str, Any], args: argparse.Namespace
) -> tuple[dict[str, Any], list[launcher.Service], int]:
    """One round at ``replicas`` per shuffler on fresh databases; leaves the deployment up."""
    fresh_databases()
    services, base = deploy(var, replicas, 1)
    driver = loadgen.Driver(fronts(base), max(1, args.concurrency // SHUFFLERS))
    source = loadgen.EpochSource({load["epoch"]: load["files"]}, EPOCH_SECONDS)
    pids = {s.process.pid for s in services}
    try:
        before, driving = cpu_seconds(pids), time.process_time()
        seconds = await driver.run(source, None, args.max_seconds, True)
        after, driving = cpu_seconds(pids), time.process_time() - driving
    except BaseException:
        launcher.stop(services)
        raise
    stats = driver.stats
    # shuffler-1.r1 -> shuffler, analyzer.w1 -> analyzer, haproxy:... -> haproxy; the rest are
    # the PostgreSQL backends.
    kinds = {s.process.pid: s.name.split(":")[0].split(".")[0].split("-")[0] for s in services}
    by_kind: dict[str, float] = {}
    for pid, t in after.items():
        kind = kinds.get(pid, "postgres")
        by_kind[kind] = by_kind.get(kind, 0.0) + t - before.get(pid, 0.0)
    cpu = sum(by_kind.values())
    stored = stored_contributions()
    by_shuffler = {f"shuffler_{i + 1}": c[202] for i, c in sorted(stats.by_shuffler.items())}
    result = {
        "replicas": replicas,
        "seconds": round(seconds, 2),
        "accepted": stats.accepted,
        "rate": round(stats.accepted / seconds, 1),
        "p50_ms": round(loadgen.percentile(stats.latencies, 0.5) * 1e3, 1),
        "p99_ms": round(loadgen.percentile(stats.latencies, 0.99) * 1e3, 1),
        "errors": stats.errors,
        "given_up": stats.given_up,
        "stored_match": stored == by_shuffler,
        "load_1min": round(os.getloadavg()[0], 2),
        # The services' CPU: shuffler and analyzer processes, HAProxy, their PostgreSQL
        # backends (the load generator, this process, is not counted).
        "cpu_s": round(cpu, 2),
        "cpu_ms_per_contribution": round(cpu * 1e3 / max(1, stats.accepted), 3),
        "cores_used": round(cpu / seconds, 2),
        "cpu_s_by": {kind: round(value, 2) for kind, value in sorted(by_kind.items())},
        # The load generator (this process): what it leaves of the machine to the services.
        "loadgen_cores": round(driving / seconds, 2),
    }
    console.log(f"ingest R={replicas}: {result}")
    if stats.accepted != args.devices or not result["stored_match"]:
        console.log(f"[red]not every request was accepted and stored once: {stored}")
    return result, services, base


def _post_close(url: str, epoch: int) -> int:
    body = {"channel_id": CHANNEL_ID, "epoch": epoch}
    answer = httpx.post(url + "/v1/admin/close", json=body, headers=ADMIN, timeout=600)
    return answer.status_code


def _batches_built(engines: list[Any]) -> bool:
    p = tables.batch_parts.c
    for engine in engines:
        ledger = make_store(engine).ledger()
        with engine.connect() as conn:
            staged = conn.execute(select(func.count()).where(p.status == "staged")).scalar_one()
        if ledger["pending"] or ledger["held"] or staged or not ledger["in_batches_unforwarded"]:
            return False
    return True


async def store_epoch(services: list[launcher.Service], base: int, epoch: int) -> dict[str, Any]:
    """Stop the analyzer, close the epoch at every shuffler, wait for the batch parts, stop
    everything and copy the shuffler databases with the parts held back."""
    launcher.stop([s for s in services if s.name.startswith("analyzer.")])
    closes = [asyncio.to_thread(_post_close, url, epoch) for url in fronts(base)]
    statuses = await asyncio.gather(*closes)
    engines = [engine_of(s) for s in SERVICES[1:]]
    try:
        deadline = time.monotonic() + 600
        while not _batches_built(engines):
            if time.monotonic() > deadline:
                raise RuntimeError("batches not built within 600 s")
            await asyncio.sleep(0.5)
        launcher.stop(services)
        parts = released = 0
        for engine in engines:
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "UPDATE batch_parts SET attempts = 0, lease_until = NULL, "
                        "last_error = NULL, next_attempt_at = :held WHERE status = 'pending'"
                    ),
                    {"held": HELD_BACK},
                )
                parts += int(conn.execute(text("SELECT count(*) FROM batch_parts")).scalar_one())
            released += make_store(engine).ledger()["in_batches_unforwarded"]
    finally:
        for engine in engines:
            engine.dispose()
    summary = {"close_statuses": statuses, "parts": parts, "released": released}
    for service in SERVICES[1:]:
        admin(
            f"DROP DATABASE IF EXISTS {PREFIX}_snap_{service} WITH (FORCE)",
            f"CREATE DATABASE {PREFIX}_snap_{service} TEMPLATE {PREFIX}_{service}",
        )
    console.log(f"stored epoch: {summary}")
    return summary


def _analyzer_state(engine: Any) -> tuple[int, int, int]:
    """Parts stored (any status), parts opened, fragments in opened parts."""
    p = analyzer_tables.batch_parts.c
    with engine.connect() as conn:
        row = conn.execute(
            select(
                func.count(),
                func.count().filter(p.status == "opened"),
                func.coalesce(func.sum(p.n_fragments).filter(p.status == "opened"), 0),
            )
        ).one()
    return int(row[0]), int(row[1]), int(row[2])


def _analyzer_check(engine: Any) -> dict[str, int]:
    t = analyzer_tables
    with engine.connect() as conn:
        statuses = dict(
            conn.execute(
                select(t.batch_parts.c.status, func.count()).group_by(t.batch_parts.c.status)
            ).all()
        )
        batches = conn.execute(select(func.count(t.batch_parts.c.batch_id.distinct()))).scalar()
        receipts = conn.execute(select(func.count()).select_from(t.receipts)).scalar()
        received = conn.execute(select(func.sum(t.receipts.c.n_contributions))).scalar()
    return {
        "opened": int(statuses.get("opened", 0)),
        "not_opened": sum(int(v) for k, v in statuses.items() if k != "opened"),
        "batches": int(batches or 0),
        "receipts": int(receipts or 0),
        "received": int(received or 0),
    }


def _release_parts() -> None:
    for service in SERVICES[1:]:
        engine = engine_of(service)
        try:
            with engine.begin() as conn:
                conn.execute(
                    text("UPDATE batch_parts SET next_attempt_at = 0 WHERE status = 'pending'")
                )
        finally:
            engine.dispose()


async def opening_round(var: Path, workers: int, stored: dict[str, Any]) -> dict[str, Any]:
    """Deliver and open the stored epoch with ``workers`` analyzer processes."""
    fresh_databases(from_snapshot=True)
    services, _ = deploy(var, 1, workers)
    engine = engine_of("analyzer")
    try:
        _release_parts()
        start = time.monotonic()
        all_stored, first = None, None
        while True:
            parts, opened, fragments = _analyzer_state(engine)
            now = time.monotonic() - start
            if first is None and fragments:
                first = (now, fragments)
            if all_stored is None and parts >= stored["parts"]:
                all_stored = now
            if opened >= stored["parts"]:
                break
            if now > 1800:
                raise RuntimeError(f"opening not done after 1800 s: {opened}/{stored['parts']}")
            await asyncio.sleep(0.1)
        check = _analyzer_check(engine)
    finally:
        engine.dispose()
        launcher.stop(services)
    result = {
        "workers": workers,
        "fragments": fragments,
        "all_stored_s": round(all_stored or now, 2),
        "all_opened_s": round(now, 2),
        "rate": round(fragments / now, 1),
        # From the first part opened (the opening pools are started) to the last.
        "steady_rate": round((fragments - first[1]) / max(1e-9, now - first[0]), 1)
        if first
        else None,
        "check": check,
        "correct": check["not_opened"] == 0
        and check["receipts"] == check["batches"]
        and check["received"] == stored["released"],
        "load_1min": round(os.getloadavg()[0], 2),
    }
    console.log(f"opening W={workers}: {result}")
    return result


def balanced_order(pairs: int) -> list[int]:
    """1, 2, 2, 1, 1, 2, ...: ``pairs`` pairs of the two layouts, every other pair reversed
    (ABBA), so a linear drift of the machine's load adds the same to both layouts."""
    return [n for i in range(pairs) for n in ((1, 2) if i % 2 == 0 else (2, 1))]


def pooled(rounds: list[dict[str, Any]], key: str, value: int) -> float:
    """Accepted contributions per second over every round where ``key`` is ``value``."""
    chosen = [r for r in rounds if r[key] == value]
    return float(sum(r["accepted"] for r in chosen) / sum(r["seconds"] for r in chosen))


def cpu_per(rounds: list[dict[str, Any]], replicas: int, kind: str | None = None) -> float:
    """Service CPU milliseconds per accepted contribution over the rounds at ``replicas`` (of
    the processes of one ``kind``: shuffler, analyzer, haproxy, postgres; default all)."""
    chosen = [r for r in rounds if r["replicas"] == replicas]
    used = sum(r["cpu_s"] if kind is None else r["cpu_s_by"].get(kind, 0.0) for r in chosen)
    return float(used * 1e3 / sum(r["accepted"] for r in chosen))


def transactions_per(rounds: list[dict[str, Any]], replicas: int) -> float:
    """Transactions committed in the shuffler databases per 1,000 accepted contributions, over
    the rounds at ``replicas`` that counted them (not the last: it stays up for the epoch)."""
    chosen = [r for r in rounds if r["replicas"] == replicas and "transactions" in r]
    committed = sum(sum(r["transactions"].values()) for r in chosen)
    return float(committed * 1e3 / max(1, sum(r["accepted"] for r in chosen)))


def cores(rounds: list[dict[str, Any]], replicas: int) -> float:
    """Cores the services used on average over the rounds at ``replicas``."""
    chosen = [r for r in rounds if r["replicas"] == replicas]
    return float(sum(r["cpu_s"] for r in chosen) / sum(r["seconds"] for r in chosen))


def loadgen_cores(rounds: list[dict[str, Any]], replicas: int) -> float:
    """Cores the load generator used on average over the rounds at ``replicas``."""
    chosen = [r for r in rounds if r["replicas"] == replicas]
    used = sum(r["loadgen_cores"] * r["seconds"] for r in chosen)
    return float(used / sum(r["seconds"] for r in chosen))


def pair_ratios(rounds: list[dict[str, Any]]) -> list[float]:
    """Rate at 2 over rate at 1 within each adjacent pair of rounds (1, 2) or (2, 1)."""
    ratios = []
    for first, second in zip(rounds[::2], rounds[1::2], strict=False):
        by = {first["replicas"]: first["rate"], second["replicas"]: second["rate"]}
        ratios.append(by[2] / by[1])
    return ratios


def section(summary: dict[str, Any]) -> str:
    """The docs/benchmarks.md section."""
    ingest, opening = summary["ingest"], summary["opening"]
    rate = {r: pooled(ingest, "replicas", r) for r in (1, 2)}
    open_rate = {
        w: statistics.median(x["rate"] for x in opening if x["workers"] == w) for w in (1, 2)
    }
    lines = [
        "## Replicas and analyzer workers (issue 17)",
        "",
        f"Command: `{summary['command']}`.",
        f"Machine: {summary['machine']}: 2 shared cores (other work ran alongside; 1-minute",
        f"load average {summary['load_before']:.1f} before the run, "
        f"{min(summary['loads']):.1f}–{max(summary['loads']):.1f} at the end of the rounds);",
        "PostgreSQL 15 on the same machine, HAProxy in front of every service in every round.",
        "",
        f"**Ingest**, {summary['shufflers']} shuffler(s): the same {summary['devices']:,} "
        "sealed contributions (k-RAPPOR",
        f"`homepage`, ~{summary['request_bytes'] / 1024:.1f} KB per request, distinct devices",
        "enrolled over HTTP, services/tools/loadgen/) replayed in each round against fresh",
        f"databases over {summary['concurrency']} keep-alive connections, as fast as the "
        "shufflers answer.",
        "",
        f"{summary['warmup_rounds']} warm-up round(s) at 1 replica first (not counted), then "
        "the layouts in the order 1, 2, 2, 1, ...",
        "",
        "| round | replicas per shuffler | seconds | accepted/s | p50 ms | p99 ms | errors "
        "| stored = accepted | load (1 min) | service CPU ms per contribution | cores used |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    numbered = [("w", r) for r in summary["warmup"]] + list(enumerate(ingest, start=1))
    for i, r in numbered:
        lines.append(
            f"| {i} | {r['replicas']} | {r['seconds']} | {r['rate']:,.0f} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {sum(r['errors'].values()) + r['given_up']} | "
            f"{'yes' if r['stored_match'] else 'NO'} | {r['load_1min']} | "
            f"{r['cpu_ms_per_contribution']} | {r['cores_used']} |"
        )
    ratio, pairs = rate[2] / rate[1], pair_ratios(ingest)
    lines += [
        "",
        f"Pooled accepted/s (all accepted / all seconds of the layout): 1 replica "
        f"**{rate[1]:,.0f}**, 2 replicas **{rate[2]:,.0f}**: ratio **{ratio:.3f}** (target ≥ 0.9: "
        f"{'met' if ratio >= 0.9 else '**not met**'}). Within each adjacent pair: "
        + ", ".join(f"{x:.2f}" for x in pairs)
        + f" (median {statistics.median(pairs):.2f}).",
        "",
        "Service CPU per contribution (shuffler and analyzer processes, HAProxy and their",
        "PostgreSQL backends; CPU seconds over accepted contributions, all rounds of the layout):",
        f"1 replica **{cpu_per(ingest, 1):.2f} ms**, 2 replicas **{cpu_per(ingest, 2):.2f} ms** "
        f"(ratio {cpu_per(ingest, 2) / cpu_per(ingest, 1):.2f}); cores the services used on "
        f"average: {cores(ingest, 1):.2f} vs {cores(ingest, 2):.2f} of 2, the load generator "
        f"{loadgen_cores(ingest, 1):.2f} vs {loadgen_cores(ingest, 2):.2f}. By part (ms per "
        "contribution, 1 vs 2 replicas): "
        + ", ".join(
            f"{kind} {cpu_per(ingest, 1, kind):.2f} vs {cpu_per(ingest, 2, kind):.2f}"
            for kind in ("shuffler", "postgres", "haproxy", "analyzer")
        )
        + ". Transactions committed in the shuffler databases per 1,000 contributions (group "
        f"commits, background polls, start-up): {transactions_per(ingest, 1):.0f} vs "
        f"{transactions_per(ingest, 2):.0f}.",
        "",
        f"**Opening**, one stored epoch: {summary['stored']['parts']:,} batch parts, "
        f"{opening[0]['fragments']:,} fragments, {summary['stored']['released']:,}",
        f"contributions released by the {summary['shufflers']} shuffler(s) (copied databases, "
        "parts held back until",
        "the analyzer processes are ready), delivered through HAProxy to W analyzer processes",
        "(each with its default 2 opening processes) on one PostgreSQL database. Parts of",
        f"{PART_FRAGMENTS:,} fragments (`ESA_SHUFFLER_PART_FRAGMENTS`), so workers open different",
        "parts at once. Times from the release of the parts; fragments opened/s = fragments /",
        "time to all opened (each analyzer starts its opening processes before it reports",
        "ready), and from the first part opened to the last.",
        "",
        "| round | analyzer workers | all parts stored (s) | all opened (s) | fragments opened/s "
        "| after the first part | every part opened once, received = released |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(opening, start=1):
        lines.append(
            f"| {i} | {r['workers']} | {r['all_stored_s']} | {r['all_opened_s']} | "
            f"{r['rate']:,.0f} | {r['steady_rate'] or 0:,.0f} | {'yes' if r['correct'] else 'NO'} |"
        )
    open_ratio = open_rate[2] / open_rate[1]
    steady = {
        w: statistics.median(x["steady_rate"] or 0.0 for x in opening if x["workers"] == w)
        for w in (1, 2)
    }
    lines += [
        "",
        f"Median fragments opened/s: 1 worker **{open_rate[1]:,.0f}**, 2 workers "
        f"**{open_rate[2]:,.0f}**: ratio **{open_ratio:.2f}** "
        f"(target ≥ 0.9: {'met' if open_ratio >= 0.9 else '**not met**'}); after the first part "
        f"opened: {steady[1]:,.0f} vs {steady[2]:,.0f}, ratio **{steady[2] / steady[1]:.2f}**.",
    ]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    var = out / "var"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    summary: dict[str, Any] = {
        "command": "flock /tmp/esa-bench.lock .venv/bin/python benchmarks/replicas.py "
        + " ".join(sys.argv[1:]),
        "machine": machine(pinned=False),
        "load_before": os.getloadavg()[0],
        "devices": args.devices,
        "shufflers": SHUFFLERS,
        "concurrency": args.concurrency // SHUFFLERS * SHUFFLERS,
    }
    try:
        load = await prepare_load(var, out, args)
        summary["request_bytes"] = load["request_bytes"]
        order = [1] * args.warmup + balanced_order(args.rounds)
        summary["warmup_rounds"], summary["ingest"], summary["warmup"] = args.warmup, [], []
        for n, replicas in enumerate(order):
            result, services, base = await ingest_round(var, replicas, load, args)
            summary["warmup" if n < args.warmup else "ingest"].append(result)
            if n < len(order) - 1 or not args.opening_rounds:
                launcher.stop(services)
                # Every transaction of the round (ingest, background polls, start-up).
                result["transactions"] = transactions()
        summary["opening"] = []
        if args.opening_rounds:
            summary["stored"] = await store_epoch(services, base, load["epoch"])
            summary["opening"] = [
                await opening_round(var, workers, summary["stored"])
                for workers in balanced_order(args.opening_rounds)
            ]
    finally:
        if not args.keep:
            drop_all()
    summary["loads"] = [r["load_1min"] for r in summary["ingest"] + summary["opening"]]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--devices", type=int, default=30_000, help="contributions per round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="pairs of ingest rounds (1, 2, then 2, 1, ...)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="ingest rounds at 1 replica first, not counted"
    )
    parser.add_argument(
        "--opening-rounds", type=int, default=1, help="pairs of opening rounds (1, 2 workers)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=144, help="connections in all (split over shufflers)"
    )
    parser.add_argument("--workers", type=int, default=2, help="sealing processes")
    parser.add_argument(
        "--shufflers",
        type=int,
        default=3,
        help="trust domains (3 share the 2 cores; 1: a replica gets the spare core)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=600, help="longest ingest round (seconds)"
    )
    parser.add_argument("--out", default="/tmp/esa-replicas", help="folder for results and var")
    parser.add_argument("--keep", action="store_true", help="keep the databases afterwards")
    args = parser.parse_args()
    if not 1 <= args.shufflers <= args.concurrency:
        parser.error(f"--shufflers {args.shufflers}: from 1 to --concurrency")
    use_shufflers(args.shufflers)
    summary = asyncio.run(run(args))
    out = Path(args.out)
    summary.pop("load_files", None)
    (out / "replicas.json").write_text(json.dumps(summary, indent=1, default=str))
    if not summary["opening"]:  # a quick ingest-only run (--opening-rounds 0): the numbers
        print(json.dumps(summary["ingest"], indent=1))
        return
    text_section = section(summary)
    (out / "replicas.md").write_text(text_section + "\n")
    print(text_section)


if __name__ == "__main__":
    run_main(main)
