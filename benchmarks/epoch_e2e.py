"""One epoch from devices to release in one run: N simulated devices on the catalogue's
``homepage`` channel (k-RAPPOR, k = 64, ε = 2) through 3 shufflers, the epoch closed at every
shuffler, every part delivered, opened and accumulated at the analyzer, the release read.

Run: ``flock /tmp/esa-bench.lock .venv/bin/python benchmarks/epoch_e2e.py --devices 1000000
[--profile DIR] [--write]``. A real ``esa up`` deployment (launcher: 1 analyzer + 3
shufflers, SQLite, default settings; a one-day epoch closed over ``POST /v1/admin/close``).
Devices: a pool of ``--pool`` real reports (Zipf page values encoded by the k-RAPPOR
mechanism); device i sends report i mod pool, every fragment sealed afresh to the analyzer for
this epoch (the analyzer counts a repeated sealed fragment once), in its own contribution (new
nonce, its own client token, sealed to a shuffler picked uniformly), all sealed before the
clock starts and replayed over keep-alive connections as fast as the shufflers answer. Tokens
are issued with each shuffler's own token secret (enrolling 10^6 devices over HTTP would
measure enrolment). Printed: each phase's wall time and every service's CPU in it, every
process's peak RSS (``VmHWM``), fragments/s per stage, conservation, the estimate against the
truth, and the analyzer's opening-pool rate measured in the same run on the same machine,
before ingest and after the release (the median of five timings each; the close → release
target is 1.25 × fragments ÷ the faster of the two). With ``--profile`` py-spy records
shuffler-1 during ingest and during its close, and the analyzer with its opening workers from the
close to the release (flame graphs and the hottest functions).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _profile import Profile, top_frames
from _report import add_write, machine, quiet_worker, run_main, write_section

from analyzer.opening import FragmentOpener
from common.envelope import (
    Contribution,
    FragmentContext,
    KeyRing,
    load_or_create_x25519,
    load_x25519_public,
    new_nonce,
    seal_contribution,
    seal_fragment,
)
from common.mechanisms import SeededSource, krappor
from common.wire import b64
from encoder_client.sealing import shuffler_slot
from services.cli import launcher
from services.tools import loadgen
from services.tools.catalogue import DEFAULT_CHANNELS
from services.tools.loadgen.target import RECORD
from shuffler.intake import TokenAuthority

SECTION = "## One epoch of 10^6 devices, devices to release"
HOMEPAGE = next(c for c in DEFAULT_CHANNELS if c.id == "homepage")
CHANNEL = HOMEPAGE.model_copy(update={"epoch_seconds": 86_400})
PARAMS = krappor.KRapporParams(**CHANNEL.params)
TOKEN = "development"
#: Fragments each timing of the opening pool opens (the pool's rate, same run, services idle),
#: and timings per measurement; the rate is measured before ingest and after the release.
RATE_SAMPLE = 40_000
RATE_REPEATS = 5


@dataclass
class Processes:
    """Every service's process tree, read from ``/proc`` every two seconds for peak RSS
    (``VmHWM``, the kernel's own high-water mark of each process: a process that starts and
    ends between two reads is missed, a long-lived one never under-read) and at each phase
    boundary for CPU seconds per service; beside them the PostgreSQL server (with
    ``postgres``), this benchmark's own process (the load generator) and the machine's idle and
    I/O-wait time (``/proc/stat``, all cores). Each read is one pass over ``/proc/*/stat`` and
    one ``status`` per service process: this process shares the two cores with what it
    measures."""

    services: dict[str, int]
    postgres: bool
    peaks: dict[str, int] = field(default_factory=dict)
    marks: list[tuple[str, dict[str, float]]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.done.wait(2.0):
            self.sample()

    def sample(self) -> dict[str, float]:
        table = loadgen.process_table()
        cpu: dict[str, float] = {}
        for name, pid in self.services.items():
            cpu[name] = 0.0
            for member in loadgen.process_tree(pid, table):
                try:
                    status = Path(f"/proc/{member}/status").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                label = name if member == pid else f"{name} child {member}"
                hwm = int(status.split("VmHWM:", 1)[1].split()[0])
                self.peaks[label] = max(self.peaks.get(label, 0), hwm)
                cpu[name] += loadgen.stat_seconds(table[member][1])
        return cpu | _beside(table if self.postgres else None)

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self.sample()))

    def cpu_by_phase(self) -> dict[str, dict[str, float]]:
        return {
            phase: {n: round(cpu[n] - before[n], 1) for n in cpu}
            for (_, before), (phase, cpu) in zip(self.marks, self.marks[1:], strict=False)
        }


def _beside(table: loadgen.ProcessTable | None) -> dict[str, float]:
    """CPU seconds of what runs beside the services: the PostgreSQL server (given the process
    table), this process (the load generator), and the machine's idle and I/O-wait time."""
    own = os.times()
    idle = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[4:6]]
    return {
        **({"postgres server": loadgen.server_cpu_seconds("postgres", table)} if table else {}),
        "load generator (this process)": own.user + own.system,
        "idle + iowait (machine)": sum(idle) / os.sysconf("SC_CLK_TCK"),
    }


def _deployment(var: Path, template: str | None) -> list[launcher.Service]:
    specs = launcher.prepare(
        var,
        3,
        launcher.free_base_port(4),
        database_template=template,
        channels=[CHANNEL],
        overrides=launcher.DEVELOPMENT_TOKENS,
    )
    services = launcher.start_all(specs, var / "logs")
    launcher.wait_config(services[0], 120)
    return services


def _report_pool(size: int) -> tuple[list[tuple[bytes, ...]], list[int]]:
    """``size`` real reports (their fragments, not sealed: each device seals its own, the
    analyzer counting a repeated sealed fragment once); their values."""
    values = (np.random.default_rng(7).zipf(1.3, size) - 1) % PARAMS.k
    rng, mechanism = SeededSource(7), krappor.KRappor()
    reports = [tuple(mechanism.encode_value(PARAMS, int(v), rng)) for v in values]
    return reports, [int(v) for v in values]


def _analyzer_key(var: Path) -> bytes:
    """The analyzer's raw HPKE public key (raw bytes: it goes to the sealing processes)."""
    key = load_or_create_x25519(var / "keys" / "analyzer" / "hpke.pem").public_key()
    return key.public_bytes_raw()


def _shufflers(var: Path, services: list[launcher.Service]) -> list[tuple[str, Any, str]]:
    """(id, raw HPKE public key, token secret) of each shuffler, from its config and key
    files (raw bytes: they go to the sealing processes)."""
    found = []
    for i, service in enumerate(services[1:], start=1):
        answer = httpx.get(service.url + "/v1/config", timeout=30).json()
        key = base64.b64decode(answer["public_key"])
        secret = (var / "keys" / f"shuffler-{i}" / launcher.TOKEN_SECRET_FILE).read_text()
        found.append((answer["id"], key, secret.strip()))
    return found


def _seal_share(
    job: tuple[Path, int, int, int, list[tuple[bytes, ...]], list[Any], bytes],
) -> int:
    """Write devices ``[start, stop)`` as ready requests (loadgen's record format), every
    fragment sealed afresh to the analyzer as a device seals it."""
    path, start, stop, epoch, reports, shufflers, analyzer_raw = job
    authorities = [TokenAuthority(secret.encode()) for _, _, secret in shufflers]
    keys = [load_x25519_public(raw) for _, raw, _ in shufflers]
    analyzer, context = load_x25519_public(analyzer_raw), FragmentContext(CHANNEL.id, epoch, "")
    with path.open("wb", buffering=1 << 20) as out:
        for device in range(start, stop):
            target = shuffler_slot(None, len(shufflers))
            sid, key = shufflers[target][0], keys[target]
            contribution = Contribution(
                channel_id=CHANNEL.id,
                crowd_id="",
                epoch=epoch,
                nonce=new_nonce(),
                fragments=tuple(
                    seal_fragment(f, context, CHANNEL.payload_size, analyzer)
                    for f in reports[device % len(reports)]
                ),
            )
            body = seal_contribution(contribution, sid, key)
            token = authorities[target].issue().encode()
            out.write(RECORD.pack(target, len(token), len(body)) + token + body)
    return stop - start


def _seal_devices(tmp: Path, devices: int, epoch: int, reports: Any, shufflers: Any) -> list[Path]:
    workers, analyzer = os.cpu_count() or 1, _analyzer_key(tmp)
    bounds = [devices * w // workers for w in range(workers + 1)]
    paths = [tmp / f"requests-{w}.bin" for w in range(workers)]
    jobs = [
        (paths[w], bounds[w], bounds[w + 1], epoch, reports, shufflers, analyzer)
        for w in range(workers)
    ]
    with multiprocessing.get_context("fork").Pool(workers, quiet_worker) as pool:
        assert sum(pool.map(_seal_share, jobs)) == devices
    return paths


def _opening_rate(var: Path, reports: list[tuple[bytes, ...]], epoch: int) -> float:
    """Fragments/s of the analyzer's opening pool (one process per core), on this machine now:
    the median of :data:`RATE_REPEATS` timings of :data:`RATE_SAMPLE` fragments each (one
    timing is a second or so, which a passing disturbance would move)."""
    ring = KeyRing.of(load_or_create_x25519(var / "keys" / "analyzer" / "hpke.pem"))
    context, analyzer = FragmentContext(CHANNEL.id, epoch, ""), ring.public()
    plain = [f for report in reports for f in report][:RATE_SAMPLE]
    texts = [b64(seal_fragment(f, context, CHANNEL.payload_size, analyzer)) for f in plain]
    opener = FragmentOpener(ring, os.cpu_count() or 1, 2000)
    try:
        opener.open(context, texts[:4000])  # start the workers before timing
        rates = []
        for _ in range(RATE_REPEATS):
            start = time.perf_counter()
            if len(opener.open(context, texts)) != len(texts):
                raise RuntimeError("the opening pool lost fragments while being timed")
            rates.append(len(texts) / (time.perf_counter() - start))
        return statistics.median(rates)
    finally:
        opener.close()


def _close_all(shufflers: list[launcher.Service], epoch: int) -> list[float]:
    """Close the epoch at every shuffler at once; each close's seconds."""

    def close(service: launcher.Service) -> float:
        start = time.perf_counter()
        answer = httpx.post(
            service.url + "/v1/admin/close",
            json={"channel_id": CHANNEL.id, "epoch": epoch},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=None,
        )
        answer.raise_for_status()
        return time.perf_counter() - start

    with ThreadPoolExecutor(len(shufflers)) as pool:
        return list(pool.map(close, shufflers))


#: One client for every poll: ``httpx.get`` builds a client (and its TLS context) per call,
#: ~17 ms of this process's CPU each time, which polling once a second during close -> release
#: took from the services on the same 2 cores.
POLL = httpx.Client(timeout=120)


def _metrics(url: str, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return POLL.get(url + "/metrics", headers=headers).text


def _value(text: str, name: str, labels: str = "") -> float:
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _ledger(shufflers: list[launcher.Service]) -> dict[str, int]:
    """Every shuffler's ledger states summed (``esa_shuffler_ledger_contributions``)."""
    total: dict[str, int] = {}
    for service in shufflers:
        text = _metrics(service.url, TOKEN)
        for state, value in re.findall(
            r'^esa_shuffler_ledger_contributions\{state="([a-z_0-9]+)"\} (\S+)$', text, re.M
        ):
            total[state] = total.get(state, 0) + int(float(value))
    return total


def _released(shufflers: list[launcher.Service]) -> int:
    """Batches released by the shufflers (a group of this size never aborts in practice)."""
    return sum(int(_value(_metrics(s.url, TOKEN), "esa_shuffler_batches_released_total"))
               for s in shufflers)  # fmt: skip


def _wait_release(analyzer: launcher.Service, batches: int, epoch: int) -> dict[str, Any]:
    while _value(_metrics(analyzer.url), "esa_analyzer_batches_accepted_total") < batches:
        time.sleep(1.0)
    url = f"{analyzer.url}/v1/channels/{CHANNEL.id}/estimate?epoch={epoch}"
    estimate: dict[str, Any] = POLL.get(url).json()
    return estimate


def _inside(estimate: dict[str, Any], values: list[int], devices: int) -> tuple[int, int]:
    """Bins whose estimate is within 6 standard errors of the truth × the kept share. Each of
    the pool's reports is sent by devices ÷ pool devices, so its noise counts that many times:
    the estimate's standard error is the independent-report one × sqrt(devices ÷ pool)."""
    truth = np.bincount([values[d % len(values)] for d in range(devices)], minlength=PARAMS.k)
    kept = estimate["n"] / devices
    gap = np.abs(np.array(estimate["values"]) - truth * kept)
    repeats = devices / len(values)
    error = np.array(estimate["std_errors"]) * np.sqrt(max(repeats, 1.0))
    return int(np.sum(gap <= 6 * error)), PARAMS.k


@contextlib.contextmanager
def _postgres(server: str | None) -> Iterator[str | None]:
    """Fresh databases for the analyzer and the three shufflers on ``server``
    (``user@host:port``), dropped afterwards; None: SQLite files."""
    if server is None:
        yield None
        return
    import psycopg

    user, _, hostport = server.partition("@")
    host, _, port = hostport.partition(":")
    prefix = f"esa_e2e_{os.getpid()}"
    names = [f"{prefix}_{s}" for s in ("analyzer", "shuffler_1", "shuffler_2", "shuffler_3")]
    with psycopg.connect(
        host=host, port=int(port), user=user, dbname="postgres", autocommit=True
    ) as admin:
        for name in names:
            admin.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        try:
            yield f"postgresql+psycopg://{user}@{hostport}/{prefix}_{{service}}"
        finally:
            for name in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]


def run(
    devices: int, pool: int, connections: int, profile: Path | None, postgres: str | None
) -> dict[str, Any]:
    """The whole epoch; every number printed or written."""
    with tempfile.TemporaryDirectory(prefix="esa-epoch-e2e-") as tmp, _postgres(postgres) as url:
        var = Path(tmp)
        services = _deployment(var, url)
        try:
            found = _measure(var, services, devices, pool, connections, profile)
        finally:
            launcher.stop(services)
    return {"database": "PostgreSQL" if postgres else "SQLite", **found}


def _measure(
    var: Path,
    services: list[launcher.Service],
    devices: int,
    pool: int,
    connections: int,
    profile: Path | None,
) -> dict[str, Any]:
    analyzer, shufflers = services[0], services[1:]
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    start = time.perf_counter()
    reports, values = _report_pool(pool)
    paths = _seal_devices(var, devices, epoch, reports, _shufflers(var, services))
    prepare_seconds = time.perf_counter() - start
    rate_before = _opening_rate(var, reports, epoch)
    on_postgres = any("postgresql" in s.spec.env.get(f"ESA_{k}_DATABASE_URL", "")
                      for s in services if s.spec for k in ("ANALYZER", "SHUFFLER"))  # fmt: skip
    processes = Processes(services={s.name: s.process.pid for s in services}, postgres=on_postgres)
    threading.Thread(target=processes.run, daemon=True).start()
    processes.mark("start")
    recorder = None if profile is None else Profile(shufflers[0].process.pid, profile / "ingest")
    driver = loadgen.Driver([s.url for s in shufflers], concurrency=connections)
    ingest = asyncio.run(driver.run(loadgen.FileSource(paths), None, 10**9, until_empty=True))
    if recorder is not None:
        recorder.stop()
    processes.mark("ingest")
    recorder = None if profile is None else Profile(shufflers[0].process.pid, profile / "close")
    opening = None if profile is None else Profile(analyzer.process.pid, profile / "release")
    start = time.perf_counter()
    closes = _close_all(shufflers, epoch)
    if recorder is not None:
        recorder.stop()
    processes.mark("close")
    estimate = _wait_release(analyzer, _released(shufflers), epoch)
    release = time.perf_counter() - start
    if opening is not None:
        opening.stop()
    processes.mark("deliver, open, accumulate, release")
    processes.done.set()
    rate_after = _opening_rate(var, reports, epoch)
    rate = max(rate_before, rate_after)  # the stricter target
    ledger = _ledger(shufflers)
    fragments = sum(len(reports[d % len(reports)]) for d in range(devices))
    accepted = driver.stats.accepted
    inside, bins = _inside(estimate, values, devices)
    accounted = sum(ledger.get(s, 0) for s in (
        "pending", "held", "in_batches_forwarded", "in_batches_unforwarded",
        "in_batches_refused", "deleted_by_algorithm_3", "purged"))  # fmt: skip
    return {
        "devices": devices,
        "distinct_reports": pool,
        "fragments": fragments,
        "fragments_per_contribution": round(fragments / devices, 2),
        "prepare_seconds (not counted)": round(prepare_seconds, 1),
        "opening_pool_rate (before ingest; after the release)": (
            f"{rate_before:.0f}; {rate_after:.0f}"
        ),
        "opening_pool_rate (the faster: the target's)": round(rate),
        "ingest_seconds": round(ingest, 1),
        "ingest_contributions_per_second": round(accepted / ingest),
        "ingest_fragments_per_second": round(fragments / ingest),
        "close_seconds (slowest shuffler)": round(max(closes), 1),
        "close_seconds (each)": ", ".join(f"{c:.1f}" for c in closes),
        "close_to_release_seconds": round(release, 1),
        "close_to_release_fragments_per_second": round(fragments / release),
        "target_close_to_release_seconds (1.25 x fragments / pool rate)": round(
            1.25 * fragments / rate, 1
        ),
        "close_share_of_close_to_release": round(max(closes) / release, 3),
        "acknowledged (202)": accepted,
        "not acknowledged": devices - accepted,
        "shuffler_ledger": ledger,
        "lost (acknowledged - accounted)": accepted - accounted,
        "released_n (analyzer)": estimate["n"],
        "counted_twice (analyzer n - forwarded)": estimate["n"]
        - ledger.get("in_batches_forwarded", 0),
        "bins_within_6_se_of_truth (se of the pooled reports)": f"{inside}/{bins}",
        "cpu_seconds_by_phase": processes.cpu_by_phase(),
        "peak_rss_mb": {p: round(kb / 1024) for p, kb in sorted(processes.peaks.items())},
    }


def _profiles(profile: Path) -> str:
    """The hottest functions of each recording, as Markdown lines."""
    lines = []
    for party, phase, within in (
        ("shuffler-1", "ingest", ""),
        ("shuffler-1", "close", "close_group (shuffler/closing.py"),
        ("the analyzer and its opening workers", "release", ""),
    ):
        raw = (profile / phase).with_suffix(".txt")
        if not raw.exists():
            continue
        lines.append(f"\n\n{party}, {phase} (py-spy, share of busy samples):\n")
        for frame, inside, alone in top_frames(raw, within):
            lines.append(f"- {alone:.1%} alone, {inside:.1%} inside: `{frame}`")
    return "\n".join(lines)


def _section(result: dict[str, Any], command: str, profile: Path | None) -> str:
    rows = []
    for key, value in result.items():
        shown = json.dumps(value) if isinstance(value, dict) else value
        rows.append(f"| {key} | {shown} |")
    return "\n".join(
        [
            f"Command: `{command}`.",
            f"Machine: {machine(pinned=False)}; load average at the end {os.getloadavg()[0]:.1f}.",
            "",
            "| measure | value |",
            "|---|---|",
            *rows,
        ]
    ) + (_profiles(profile) if profile else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1_000_000)
    parser.add_argument("--pool", type=int, default=20_000, help="distinct device reports")
    parser.add_argument("--connections", type=int, default=48, help="per shuffler")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy recordings here")
    parser.add_argument(
        "--postgres", default=None, help="user@host:port: every service on fresh PostgreSQL"
    )
    add_write(parser)
    args = parser.parse_args()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    result = run(args.devices, args.pool, args.connections, args.profile, args.postgres)
    print(json.dumps(result, indent=2))
    if args.profile is not None:
        print(_profiles(args.profile))
    command = "flock /tmp/esa-bench.lock .venv/bin/python benchmarks/epoch_e2e.py " + " ".join(
        sys.argv[1:]
    )
    title = SECTION + (" (PostgreSQL)" if args.postgres else " (SQLite)")
    write_section(title, _section(result, command, args.profile), args.write)


if __name__ == "__main__":
    run_main(main)
