"""The faults of issue 49, each as a scenario under a verified ``esa loadtest``
(:mod:`tests.faults.harness`): the tests run them short, ``benchmarks/faults.py`` longer.

Each returns the :class:`~tests.faults.harness.Row` of docs/reliability.md, with what was
seen during the fault (``seen``) for the tests to assert on.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from analyzer.store import AnalyzerStore
from common.wire import MAX_EPOCH_SECONDS
from encoder_client import Client
from runtime import db, failpoints
from services.cli import launcher
from services.tools.credentials import Credentials
from services.tools.loadtest import verify
from shuffler import tables as shuffler_tables
from tests.support import TEST_SHUFFLER_SETTINGS, ServiceProcess

from .cluster import Cluster
from .harness import (
    TICKS,
    Deployed,
    Load,
    LoadRun,
    Row,
    deployment,
    faketime,
    stop_loads,
    time_until,
)
from .proxy import FaultProxy

#: Seconds of load before a fault starts (epochs delivered normally first).
LEAD_SECONDS = 3.0


def analyzer_outage(
    tmp: Path, load: Load, down_seconds: float, databases: Mapping[str, str] | None = None
) -> Row:
    """Fault 2: the analyzer stopped for ``down_seconds`` (several 3-second epochs) under
    load, then started again. The shufflers keep taking contributions, closing epochs and
    holding their parts, and forward them once it is back; the time to recover is from its
    restart until no shuffler holds an unforwarded part. ``databases``: every party's
    (:func:`every_party_on_postgres`), else SQLite."""
    with deployment(tmp / "var", databases=databases) as deployed:
        run = LoadRun.against(deployed, tmp / "out", load).start()
        run.wait_running()
        time.sleep(LEAD_SECONDS)  # pacing: the fault starts a few epochs into the run
        deployed.analyzer.stop()
        stopped = time.monotonic()
        # the shufflers close the epochs that end meanwhile and hold their parts
        time_until(lambda: deployed.unforwarded() > 0, down_seconds + 10)
        held = deployed.unforwarded()
        time.sleep(max(0.0, down_seconds - (time.monotonic() - stopped)))
        deployed.analyzer.start()
        recovered = time_until(lambda: deployed.unforwarded() == 0, 120)
        summary = run.finish()
    seen = {"held_parts": held, "log": run.tail()}
    return Row("analyzer unreachable", _backend(databases), summary, recovered, seen)


def bad_network(
    tmp: Path, load: Load, fault_seconds: float, databases: Mapping[str, str] | None = None
) -> Row:
    """Fault 5: every shuffler reaches the analyzer through a :class:`FaultProxy` that adds
    ``latency`` seconds for ``fault_seconds``, then cuts every part mid-request or drops its
    answer for ``fault_seconds``, then heals. Delivery completes once the fault ends and a
    part the analyzer stored but never acknowledged is not counted twice; the time to
    recover is from the heal until no shuffler holds an unforwarded part. ``databases``:
    every party's (:func:`every_party_on_postgres`), else SQLite."""
    base = launcher.free_base_port(3)
    proxy = FaultProxy(target_port=base).start()
    try:
        with deployment(
            tmp / "var", base_port=base, analyzer_url=proxy.url, databases=databases
        ) as deployed:
            run = LoadRun.against(deployed, tmp / "out", load).start()
            run.wait_running()
            time.sleep(LEAD_SECONDS)  # pacing: the fault starts a few epochs into the run
            proxy.mode = "slow"
            time.sleep(fault_seconds)
            proxy.mode = "reset"
            # at least one part cut each way (a part is sent every 3-second epoch and retried)
            time_until(lambda: proxy.cut_requests > 0 and proxy.cut_answers > 0, 60)
            time.sleep(fault_seconds)
            proxy.mode = "pass"
            recovered = time_until(lambda: deployed.unforwarded() == 0, 120)
            summary = run.finish()
    finally:
        proxy.stop()
    seen = {"cut_requests": proxy.cut_requests, "cut_answers": proxy.cut_answers}
    return Row(
        "bad network shuffler → analyzer",
        _backend(databases),
        summary,
        recovered,
        seen | {"log": run.tail()},
    )


# --- every party on PostgreSQL (faults 2 and 5 on the deployment's other backend) ----------


@contextmanager
def every_party_on_postgres(bin: Path, shufflers: int = 2) -> Iterator[dict[str, str]]:
    """A private cluster (:class:`Cluster`) with one database per party, as ``esa up
    --database-template`` gives each its own: the ``databases`` of :func:`deployment`."""
    cluster = Cluster.create(bin)
    try:
        cluster.start()
        names = ["analyzer", *(f"shuffler-{i}" for i in range(1, shufflers + 1))]
        yield {name: cluster.database(name.replace("-", "_")) for name in names}
    finally:
        cluster.remove()


def _backend(databases: Mapping[str, str] | None) -> str:
    """The backend column of a row: PostgreSQL when the parties' databases are given."""
    return "PostgreSQL" if databases else "SQLite"


#: A k-RR channel whose one epoch outlasts any run: a device's refused contribution can be
#: retried for as long as a database is down (each scenario has its own deployment).
LONG = TICKS.model_copy(update={"id": "long", "epoch_seconds": MAX_EPOCH_SECONDS})


@dataclass
class Readiness:
    """``GET /readyz`` of one service every 0.2 s in a thread, each status counted."""

    url: str
    seen: Counter[int] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Readiness:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.seen[httpx.get(self.url + "/readyz", timeout=5).status_code] += 1
            except httpx.HTTPError:
                self.seen[0] += 1  # no answer at all


def ready(url: str) -> bool:
    return httpx.get(url + "/readyz", timeout=5).status_code == 200


def postgres_restart(tmp: Path, load: Load, down_seconds: float, bin: Path) -> Row:
    """Fault 1: shuffler-1's PostgreSQL (a private cluster, :class:`Cluster`) stopped
    mid-ingest (``pg_ctl stop -m fast``: open transactions rolled back, connections
    dropped) and started again ``down_seconds`` later. The shuffler answers 503 (nothing
    stored) while it cannot commit, ``/readyz`` says so, the devices wait the refusals out;
    the time to recover is from the server's start until ``/readyz`` answers 200 again."""
    cluster = Cluster.create(bin)
    try:
        cluster.start()
        databases = {"shuffler-1": cluster.database("shuffler_1")}
        with deployment(tmp / "var", LONG, databases=databases) as deployed:
            run = LoadRun.against(deployed, tmp / "out", load, LONG.id).start()
            run.wait_running()
            with Readiness(deployed.shufflers[0].url) as readiness:
                time.sleep(LEAD_SECONDS)  # pacing: the fault starts into the run
                cluster.stop("fast")
                time.sleep(down_seconds)
                cluster.start()
                recovered = time_until(lambda: ready(deployed.shufflers[0].url), 60)
            summary = run.finish()
    finally:
        cluster.remove()
    seen = {"readyz": dict(readiness.seen), "log": run.tail()}
    return Row("PostgreSQL restarted mid-ingest", "PostgreSQL", summary, recovered, seen)


@contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -t tmpfs -o size=...``; root only), unmounted after."""
    folder = Path(tempfile.mkdtemp(prefix="esa-tmpfs-"))
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    if subprocess.run(mount, check=False).returncode != 0:
        folder.rmdir()
        raise RuntimeError(f"cannot mount a tmpfs ({' '.join(mount)}): CAP_SYS_ADMIN needed")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        folder.rmdir()


def fill(folder: Path) -> Path:
    """Write a file into ``folder`` until its filesystem has no space left; the file."""
    filler = folder / "filler"
    block = b"\0" * (1 << 16)
    with filler.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
    return filler


def full_disk(tmp: Path, load: Load, full_seconds: float) -> Row:
    """Fault 3: shuffler-1's SQLite file on a small tmpfs, filled to the last byte under
    load until a commit is refused, then kept full ``full_seconds`` longer, then freed.
    Writes are refused with ``503 storage_unavailable`` (nothing stored, ``Retry-After``),
    the database stays whole (``PRAGMA integrity_check``), and intake resumes once space
    returns; the time to recover is from the freeing until shuffler-1 acknowledges again
    (its ledger grows)."""
    with tmpfs("64m") as disk:
        database = f"sqlite:///{disk / 'shuffler.db'}"
        with deployment(tmp / "var", LONG, databases={"shuffler-1": database}) as deployed:
            run = LoadRun.against(deployed, tmp / "out", load, LONG.id).start()
            run.wait_running()
            time.sleep(LEAD_SECONDS)  # pacing: the fault starts into the run
            refused = _storage_refusals(deployed)
            filler = fill(disk)
            # the disk is full once a commit needs a new block: then it stays full this long
            time_until(lambda: _storage_refusals(deployed) > refused, 60)
            time.sleep(full_seconds)
            before = _acknowledged(deployed)
            filler.unlink()
            recovered = time_until(lambda: _acknowledged(deployed) > before, 60)
            summary = run.finish()
        with sqlite3.connect(disk / "shuffler.db") as check:
            (whole,) = check.execute("PRAGMA integrity_check").fetchone()
    seen = {"integrity": whole, "log": run.tail()}
    return Row("disk full at a shuffler", "SQLite", summary, recovered, seen)


def _storage_refusals(deployed: Deployed) -> float:
    """Contributions shuffler-1 refused ``503 storage_unavailable`` so far (its process)."""
    metrics = verify.scrape(deployed.shufflers[0].url, deployed.tokens())
    return metrics.get('esa_shuffler_contributions_rejected_total{reason="storage_unavailable"}', 0)


def _refusals(deployed: Deployed, reason: str) -> float:
    """Contributions shuffler-1 refused with ``reason`` so far (its process)."""
    metrics = verify.scrape(deployed.shufflers[0].url, deployed.tokens())
    return metrics.get(f'esa_shuffler_contributions_rejected_total{{reason="{reason}"}}', 0)


def _acknowledged(deployed: Deployed) -> float:
    """What shuffler-1's trust domain has acknowledged so far (its ledger)."""
    state = verify.shuffler_state([deployed.shufflers[0].url], deployed.tokens())
    return next(iter(state.values()))["received"]


def _opening_workers(parent: int) -> list[int]:
    """The analyzer's opening workers: its children started by ``multiprocessing`` spawn."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"spawn_main" in command:
            found.append(int(stat.parent.name))
    return found


def stopped_replica(tmp: Path, load: Load, stop_seconds: float, bin: Path) -> Row:
    """Fault 6: shuffler-1 as two replicas behind HAProxy (``esa up --replicas 2`` on a
    private PostgreSQL cluster); under load one replica is SIGSTOPped for ``stop_seconds``
    (HAProxy's health check takes it out, what it held waits) and then continued, and an
    opening worker of the analyzer is SIGKILLed while verification drains the parts. The
    time to recover is from SIGCONT until HAProxy sees the replica ready again (its
    ``/readyz`` through the process itself)."""
    cluster = Cluster.create(bin)
    try:
        cluster.start()
        for name in ("analyzer", "shuffler_1"):
            cluster.database(name)
        template = f"postgresql+psycopg://postgres@127.0.0.1:{cluster.port}/{{service}}"
        var = tmp / "var"
        services = launcher.up(
            var, 1, launcher.free_base_port(launcher.scaled_ports(1, 2, 1)), 120,
            template, replicas=2, channels=[LONG],
            overrides={**TEST_SHUFFLER_SETTINGS, "ESA_ANALYZER_OPENING_PROCESSES": "2"},
        )  # fmt: skip
        try:
            named = {s.name: s for s in services}
            run = LoadRun(var, named["haproxy:analyzer"].url, tmp / "out", load, LONG.id)
            run.start().wait_running()
            time.sleep(LEAD_SECONDS)  # pacing: the fault starts into the run
            replica = named["shuffler-1.r1"]
            os.kill(replica.process.pid, signal.SIGSTOP)
            time.sleep(stop_seconds)
            os.kill(replica.process.pid, signal.SIGCONT)
            recovered = time_until(lambda: ready(replica.url), 60)
            run.wait_for("waiting for every batch", 300)
            analyzer = next(s for s in services if s.name.startswith("analyzer"))
            workers = _opening_workers(analyzer.process.pid)
            if workers:
                os.kill(workers[0], signal.SIGKILL)
            summary = run.finish()
        finally:
            stop_loads()
            launcher.stop(services)
    finally:
        cluster.remove()
    seen = {"killed_workers": len(workers[:1]), "log": run.tail()}
    return Row("replica SIGSTOPped behind HAProxy", "PostgreSQL", summary, recovered, seen)


def clocks(
    tmp: Path, load: Load, ahead: float = 90.0, devices_off: float = 600.0, share: float = 0.1
) -> Row:
    """Fault 4: clocks that disagree. shuffler-1 runs with its wall clock ``ahead`` seconds
    ahead of the analyzer's and shuffler-2's (libfaketime, :func:`~.harness.faketime`), and
    ``share`` of the devices each run ``devices_off`` seconds ahead and behind, on two
    channels: 3-second epochs (``ticks``) and one epoch longer than the run (``long``). The
    load test counts the refusals of the devices on true time by code (``--expect-refusal
    epoch_not_open``: shuffler-1 is 30 ticks ahead) and those of the clock groups apart; after
    verification the analyzer's privacy ledger of each channel is read (``seen["ledgers"]``)
    to check that every epoch was charged once and no release covers an uncharged one. There
    is nothing to recover from (the clocks stay off): the time to recover is NaN."""
    env = {"shuffler-1": faketime(ahead)}
    with deployment(tmp / "var", TICKS, env=env, channels=[LONG]) as deployed:
        shown = _wall_clock(deployed.shufflers[0].url) - _wall_clock(deployed.shufflers[1].url)
        extra = (
            "--channel", LONG.id, "--expect-refusal", "epoch_not_open",
            "--clock-offset", f"{devices_off:g}:{share:g}",
            "--clock-offset", f"{-devices_off:g}:{share:g}",
        )  # fmt: skip
        run = LoadRun.against(deployed, tmp / "out", load, TICKS.id, extra).start()
        summary = run.finish()
        offsets = (0.0, devices_off, -devices_off)
        devices = {f"{o:+g}": _sdk_devices(deployed, tmp, o) for o in offsets}
        url = deployed.analyzer.url
        ledgers = {
            cid: httpx.get(f"{url}/v1/channels/{cid}/privacy", timeout=30).raise_for_status().json()
            for cid in (TICKS.id, LONG.id)
        }
    seen = {"ledgers": ledgers, "clock_ahead": shown, "sdk": devices, "log": run.tail()}
    fault = f"clocks: shuffler {ahead:+g} s, devices ±{devices_off / 60:g} min"
    return Row(fault, "SQLite", summary, float("nan"), seen)


class _Refusals(logging.Handler):
    """The SDK's log records of contributions it dropped: (message, error code)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.found.append((record.getMessage(), str(getattr(record, "error", ""))))


def _sdk_devices(deployed: Deployed, tmp: Path, offset: float, count: int = 8) -> dict[str, Any]:
    """``count`` devices of the Python SDK whose clock is ``offset`` seconds off, each with one
    report on the 3-second channel, flushed at once (after the load: its epochs are over):
    how many were delivered, what the outboxes still hold (nothing is retried forever) and
    the refusals the SDK logged (message, error code)."""
    refusals = _Refusals()
    logger = logging.getLogger("esa.client")
    logger.addHandler(refusals)
    delivered = left = 0
    try:
        for i in range(count):
            with Client(
                deployed.analyzer.url + "/v1/config",
                trust_file=deployed.var / launcher.TRUST_FILE,
                state_path=tmp / f"sdk-{offset:+g}-{i}.db",
                background=False,
                clock=lambda: time.time() + offset,
            ) as client:
                client.histogram(TICKS.id).report(i % 16)
                delivered += client.flush()
                left += client.state.outbox_size()
    finally:
        logger.removeHandler(refusals)
    return {"reports": count, "delivered": delivered, "left": left, "refused": refusals.found}


def _wall_clock(url: str) -> float:
    """A shuffler's wall clock when it signed its descriptor (``issued_at``, at its start:
    both shufflers start together, so the difference is their clocks')."""
    answer = httpx.get(url + "/v1/descriptor", timeout=10).raise_for_status().json()
    return float(answer["descriptor"]["issued_at"])


# --- the analyzer's own storage: its database restarted (fault 1), its disk full (fault 3) --


def forward_refusals(deployed: Deployed) -> Counter[str]:
    """The shufflers' forwarding attempts that will be retried, by what the analyzer (or the
    link) answered: ``HTTP 503 storage_unavailable`` and the like, read from their logs
    (``forward failed, will retry``, whose ``reason`` is the answer's status and body)."""
    found: Counter[str] = Counter()
    for log in sorted((deployed.var / "logs").glob("shuffler-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "forward failed, will retry" not in line:
                continue
            reason = json.loads(line).get("reason", "") if line.startswith("{") else line
            found[_answer(str(reason))] += 1
    return found


def _answer(reason: str) -> str:
    """``HTTP 503 storage_unavailable`` of ``HTTP 503: {"error":"storage_unavailable",...}``;
    a transport error's name otherwise (``ConnectError``)."""
    head, _, body = reason.partition(": ")
    if not head.startswith("HTTP "):
        return head
    try:
        code = json.loads(body).get("error", "?")
    except ValueError:  # cut at the excerpt's length, or not JSON
        code = body.split('"error":"', 1)[-1].split('"', 1)[0] if '"error":"' in body else "?"
    return f"{head} {code}"


def analyzer_postgres_restart(tmp: Path, load: Load, down_seconds: float, bin: Path) -> Row:
    """Fault 1, the analyzer's side: its PostgreSQL (a private cluster, :class:`Cluster`;
    the shufflers keep SQLite) stopped (``pg_ctl stop -m fast``) under load on a channel of
    3-second epochs, while parts arrive and are opened, and started again ``down_seconds``
    later. The analyzer refuses every part it cannot commit (``503 storage_unavailable``,
    ``Retry-After``), the shufflers keep taking contributions and retry forwarding, the
    opener blames no part (the database's failure is transient); the time to recover is from
    the server's start until no shuffler holds an unforwarded part."""
    cluster = Cluster.create(bin)
    try:
        cluster.start()
        databases = {"analyzer": cluster.database("analyzer")}
        with deployment(tmp / "var", databases=databases) as deployed:
            run = LoadRun.against(deployed, tmp / "out", load).start()
            run.wait_running()
            with Readiness(deployed.analyzer.url) as readiness:
                time.sleep(LEAD_SECONDS)  # pacing: the fault starts a few epochs into the run
                cluster.stop("fast")
                time.sleep(down_seconds)
                cluster.start()
                recovered = time_until(lambda: deployed.unforwarded() == 0, 120)
            summary = run.finish()
            refusals = forward_refusals(deployed)
            blamed = _analyzer_metric(deployed, "esa_analyzer_part_open_failures_total")
    finally:
        cluster.remove()
    seen = {
        "readyz": dict(readiness.seen),
        "forward_refusals": dict(refusals),
        "open_failures": blamed,
        "log": run.tail(),
    }
    return Row("analyzer's PostgreSQL restarted mid-ingest", "PostgreSQL", summary, recovered, seen)


def _analyzer_metric(deployed: Deployed, name: str) -> float:
    """One sample of the analyzer's ``/metrics`` (0 when absent), with its metrics token."""
    url = deployed.analyzer.url
    tokens = Credentials(folder=deployed.var / "keys").for_parties({"analyzer": url})
    return verify.scrape(url, tokens).get(name, 0.0)


def analyzer_full_disk(tmp: Path, load: Load, full_seconds: float) -> Row:
    """Fault 3, the analyzer's side: its SQLite file on a small tmpfs (root only), filled to
    the last byte under load on a channel of 3-second epochs until it refuses a part, kept
    full ``full_seconds`` longer, then freed. The analyzer refuses the parts it cannot store
    (``503 storage_unavailable``, ``Retry-After``: nothing half-written, ``PRAGMA
    integrity_check``), the shufflers keep them and forward them again once space returns;
    the time to recover is from the freeing until no shuffler holds an unforwarded part."""
    with tmpfs("64m") as disk:
        database = f"sqlite:///{disk / 'analyzer.db'}"
        with deployment(tmp / "var", databases={"analyzer": database}) as deployed:
            run = LoadRun.against(deployed, tmp / "out", load).start()
            run.wait_running()
            time.sleep(LEAD_SECONDS)  # pacing: the fault starts a few epochs into the run
            filler = fill(disk)
            # full once a commit needs a new block (the WAL grows): then it stays full
            time_until(lambda: forward_refusals(deployed)[STORAGE_REFUSAL] > 0, 60)
            time.sleep(full_seconds)
            filler.unlink()
            recovered = time_until(lambda: deployed.unforwarded() == 0, 120)
            summary = run.finish()
            refusals = forward_refusals(deployed)
            blamed = _analyzer_metric(deployed, "esa_analyzer_part_open_failures_total")
        with sqlite3.connect(disk / "analyzer.db") as check:
            (whole,) = check.execute("PRAGMA integrity_check").fetchone()
    seen = {
        "integrity": whole,
        "forward_refusals": dict(refusals),
        "open_failures": blamed,
        "log": run.tail(),
    }
    return Row("disk full at the analyzer", "SQLite", summary, recovered, seen)


#: How a shuffler's log names the analyzer's refusal of a part it could not store.
STORAGE_REFUSAL = "HTTP 503 storage_unavailable"


# --- a bad network between the devices and a shuffler (fault 5, the devices' side) ---------


def bad_device_network(tmp: Path, load: Load, fault_seconds: float) -> Row:
    """Fault 5, the devices' side: the load test's devices reach shuffler-1 through a
    :class:`FaultProxy` (registered as its URL, so the analyzer's config sends them there),
    which adds 0.5 s to every chunk for ``fault_seconds``, then for ``fault_seconds`` cuts
    every third contribution (alternately half sent, and whole sent with its 202 dropped:
    stored, the device does not know), then heals; on a channel whose one epoch outlasts the
    run, so a device retries as long as it must. A contribution sent again after its lost
    202 is answered 409 ``replayed_nonce`` and counted once (the verification reads the
    shufflers' ledgers); the time to recover is from the heal until shuffler-1's ledger
    grows."""
    base = launcher.free_base_port(3)
    proxy = FaultProxy(target_port=base + 1, latency=0.5, cut_every=3).start()
    urls = {"shuffler-1": proxy.url}
    try:
        with deployment(tmp / "var", LONG, base_port=base, public_urls=urls) as deployed:
            run = LoadRun.against(deployed, tmp / "out", load, LONG.id).start()
            run.wait_running()
            time.sleep(LEAD_SECONDS)  # pacing: the fault starts into the run
            proxy.mode = "slow"
            time.sleep(fault_seconds)
            proxy.mode = "reset"
            time_until(lambda: proxy.cut_requests > 0 and proxy.cut_answers > 0, 60)
            time.sleep(fault_seconds)
            before = _acknowledged(deployed)
            proxy.mode = "pass"
            recovered = time_until(lambda: _acknowledged(deployed) > before, 60)
            summary = run.finish()
            replayed = _refusals(deployed, "replayed_nonce")
    finally:
        proxy.stop()
    seen = {
        "cut_requests": proxy.cut_requests,
        "cut_answers": proxy.cut_answers,
        "replayed_nonce": replayed,
    }
    return Row(
        "bad network devices → shuffler", "SQLite", summary, recovered, seen | {"log": run.tail()}
    )


#: The shuffler's commit points (runtime/failpoints.py) in the order an epoch's close meets
#: them: the close, the group's evaluation, the forwarding of its first part.
SHUFFLER_POINTS = tuple(p for p in failpoints.POINTS if p.startswith("shuffler."))
#: The analyzer's commit points in the order a batch meets them (a part stored, opened, folded,
#: its batch completed, its epoch closed), but for a release's (:data:`RELEASE_POINTS`).
ANALYZER_POINTS = tuple(
    p for p in failpoints.POINTS if p.startswith("analyzer.") and ".release." not in p
)
#: A release's record, crashed when it is published after the load test.
RELEASE_POINTS = ("analyzer.release.before_commit", "analyzer.release.after_commit")
#: How long a process armed with a point may run before it must have crashed there.
POINT_TIMEOUT = 120.0
#: How long verification may take to drain: a process's restart takes 2-10 s on a loaded
#: 2-core machine, and the chains' ~25 restarts overlap only in part.
DRAIN_TIMEOUT = 400.0
#: Contributions per batch part: every batch of the run comes in several parts, so a part
#: that is not its batch's last is folded (``analyzer.fold.part_before_commit``).
PART_FRAGMENTS = "40"


@dataclass(frozen=True)
class Crash:
    """One process's death at one failpoint: its exit status (-9: SIGKILL; None: never
    reached), whether it wrote the point's line just before, and when it died."""

    point: str
    returncode: int | None
    logged: bool
    died_at: float


@dataclass
class CrashChain:
    """Crashes one process at each of ``points`` in turn (in a thread): the process runs armed
    with the first (``ESA_FAILPOINTS``, started so), and each time it dies it is started again
    armed with the next, which also makes it recover from the crash before; after the last it
    is started unarmed (``ready_at``: when it answered ready)."""

    process: ServiceProcess
    points: Sequence[str]
    crashes: list[Crash] = field(default_factory=list)
    ready_at: float | None = None
    error: BaseException | None = None
    #: Set when the test ends early: the process is not started again.
    cancelled: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _offset: int = 0

    def start(self) -> CrashChain:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"{self.process.spec.name}: crash chain still running")
        if self.error is not None:
            raise AssertionError(f"{self.process.spec.name}: crash chain failed") from self.error

    def _run(self) -> None:
        try:
            for index, point in enumerate(self.points):
                self.crashes.append(self._await(point))
                if self.cancelled.is_set():
                    return
                following = self.points[index + 1 : index + 2]
                self._restart(following[0] if following else None)
        except BaseException as error:  # reported by join
            self.error = error

    def _await(self, point: str) -> Crash:
        return _death(self.process, point, self._offset)

    def _restart(self, point: str | None) -> None:
        if point is None:
            self.process.env.pop(failpoints.ENV, None)
            self.process.start(POINT_TIMEOUT)
            self.ready_at = time.monotonic()
            return
        self.process.env[failpoints.ENV] = point
        self._offset = self.process.log_path.stat().st_size
        self.process.service = launcher.start(self.process.spec, self.process.log_path)


def crash_chains(deployed: Deployed, names: Sequence[str]) -> list[CrashChain]:
    """A :class:`CrashChain` per process named (``shuffler-N``: :data:`SHUFFLER_POINTS`,
    ``analyzer``: :data:`ANALYZER_POINTS`), started."""
    processes = {p.spec.name: p for p in (deployed.analyzer, *deployed.shufflers)}
    return [
        CrashChain(
            process=processes[n], points=ANALYZER_POINTS if n == "analyzer" else SHUFFLER_POINTS
        ).start()
        for n in names
    ]


def commit_points(tmp: Path, load: Load, databases: Mapping[str, str] | None = None) -> Row:
    """Fault 7: a crash at every commit point of the shufflers' epoch close and forwarding
    and of the analyzer's intake, fold and epoch closure (:mod:`runtime.failpoints`), and of
    a release's record.

    On a channel whose one epoch outlasts the run, the load is taken with nothing closing;
    then the load test's verification closes the epoch, and shuffler-1 (and every shuffler
    of ``databases``: PostgreSQL), armed from their start, die at each point in turn, as the
    analyzer does while their batches arrive and when verification closes its epoch; each
    death is followed by a restart armed with the next point (which recovers from the one
    before), then an unarmed one. After the load test, a release is published while the
    analyzer is armed at :data:`RELEASE_POINTS`. The time to recover: from the last crash of
    any process until it answered ready again."""
    names = ["shuffler-1", *sorted(set(databases or {}) - {"shuffler-1"}), "analyzer"]
    env = {n: {failpoints.ENV: (ANALYZER_POINTS if n == "analyzer" else SHUFFLER_POINTS)[0]}
           for n in names}  # fmt: skip
    for name in databases or {}:  # a PostgreSQL shuffler's lease is its only recovery
        env[name]["ESA_SHUFFLER_FORWARD_LEASE_SECONDS"] = "3"
    # opening in the analyzer's own process: a restart need not start a pool of workers
    overrides = {
        "ESA_SHUFFLER_PART_FRAGMENTS": PART_FRAGMENTS,
        "ESA_ANALYZER_OPENING_PROCESSES": "1",
    }
    with deployment(
        tmp / "var", LONG, databases=databases, overrides=overrides, env=env
    ) as deployed:
        chains = crash_chains(deployed, names)
        run = LoadRun.against(deployed, tmp / "out", load, LONG.id)
        run.drain_timeout = DRAIN_TIMEOUT  # every crash and restart happens while it drains
        try:
            summary = run.start().finish(DRAIN_TIMEOUT + 300)
            for chain in chains:
                chain.join(60)
        finally:  # a failed run: no process is started again once the deployment stops
            for chain in chains:
                chain.cancelled.set()
        forwarded = [_forwarded(p.env["ESA_SHUFFLER_DATABASE_URL"]) for p in deployed.shufflers]
        published, releases = publish_crashing(deployed)
    crashes = {c.process.spec.name: c.crashes for c in chains} | {"analyzer release": published}
    recovered = max((c.ready_at or 0.0) - c.crashes[-1].died_at for c in chains)
    backend = "SQLite" + (" + PostgreSQL" if databases else "")
    seen = {"crashes": crashes, "releases": releases, "forwarded": forwarded, "log": run.tail()}
    return Row("a crash at every commit point", backend, summary, recovered, seen)


def publish_crashing(deployed: Deployed) -> tuple[list[Crash], int]:
    """Publish the release of the last settled epoch with the analyzer armed at each of
    :data:`RELEASE_POINTS` in turn (each publish cut off by its crash), then start it
    unarmed; the crashes and how many releases its database then records."""
    analyzer, crashes = deployed.analyzer, []
    url = f"{analyzer.url}/v1/channels/{LONG.id}/releases"
    tokens = Credentials(folder=deployed.var / "keys").for_parties({"analyzer": analyzer.url})
    headers = tokens.admin_headers(analyzer.url)
    epoch = {"epoch": int(time.time() // LONG.epoch_seconds)}
    for point in RELEASE_POINTS:
        analyzer.stop()
        analyzer.env[failpoints.ENV] = point
        offset = analyzer.log_path.stat().st_size
        analyzer.start(POINT_TIMEOUT)  # ready: the point is reached only by a publish
        try:
            answer = httpx.post(url, json=epoch, headers=headers, timeout=60)
        except httpx.TransportError:  # cut off by the crash
            pass
        else:
            raise AssertionError(f"the publish was answered: {answer.status_code} {answer.text}")
        crashes.append(_death(analyzer, point, offset))
    analyzer.env.pop(failpoints.ENV)
    analyzer.start(POINT_TIMEOUT)
    store = AnalyzerStore(db.make_engine(analyzer.env["ESA_ANALYZER_DATABASE_URL"]))
    try:
        return crashes, len(store.releases(LONG.id))
    finally:
        store.engine.dispose()


def _death(process: ServiceProcess, point: str, offset: int) -> Crash:
    """Wait for ``process`` to die at ``point`` (killed after :data:`POINT_TIMEOUT`: never
    reached), its log read from ``offset``."""
    service = process.service
    assert service is not None
    try:
        code: int | None = service.process.wait(POINT_TIMEOUT)
    except subprocess.TimeoutExpired:
        service.kill()
        code = None
    died = time.monotonic()
    written = process.log_path.read_bytes()[offset:]
    return Crash(point, code, f"failpoint {point}: SIGKILL".encode() in written, died)


def _forwarded(database_url: str) -> tuple[int, int]:
    """A shuffler's batches of :data:`LONG` and the contributions in those it forwarded
    (from its database)."""
    b = shuffler_tables.batches.c
    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(b.status, b.n_contributions).where(b.channel_id == LONG.id))
            found = [(str(status), int(n)) for status, n in rows]
    finally:
        engine.dispose()
    return len(found), sum(n for status, n in found if status == "forwarded")
