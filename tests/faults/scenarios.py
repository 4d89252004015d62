"""The faults of issue 49, each as a scenario under a verified ``esa loadtest``
(:mod:`tests.faults.harness`): the tests run them short, ``benchmarks/faults.py`` longer.

Each returns the :class:`~tests.faults.harness.Row` of docs/reliability.md, with what was
seen during the fault (``seen``) for the tests to assert on.
"""

from __future__ import annotations

import errno
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

import httpx
from sqlalchemy import select

from analyzer.store import AnalyzerStore
from common.wire import MAX_EPOCH_SECONDS
from runtime import db, failpoints
from services.cli import launcher
from services.tools.credentials import Credentials
from services.tools.loadtest import verify
from shuffler import tables as shuffler_tables
from tests.support import TEST_SHUFFLER_SETTINGS, ServiceProcess

from .cluster import Cluster
from .harness import TICKS, Deployed, Load, LoadRun, Row, deployment, stop_loads, time_until
from .proxy import FaultProxy

#: Seconds of load before a fault starts (epochs delivered normally first).
LEAD_SECONDS = 3.0


def analyzer_outage(tmp: Path, load: Load, down_seconds: float) -> Row:
    """Fault 2: the analyzer stopped for ``down_seconds`` (several 3-second epochs) under
    load, then started again. The shufflers keep taking contributions, closing epochs and
    holding their parts, and forward them once it is back; the time to recover is from its
    restart until no shuffler holds an unforwarded part."""
    with deployment(tmp / "var") as deployed:
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
    return Row("analyzer unreachable", "SQLite", summary, recovered, seen)


def bad_network(tmp: Path, load: Load, fault_seconds: float) -> Row:
    """Fault 5: every shuffler reaches the analyzer through a :class:`FaultProxy` that adds
    ``latency`` seconds for ``fault_seconds``, then cuts every part mid-request or drops its
    answer for ``fault_seconds``, then heals. Delivery completes once the fault ends and a
    part the analyzer stored but never acknowledged is not counted twice; the time to
    recover is from the heal until no shuffler holds an unforwarded part."""
    base = launcher.free_base_port(3)
    proxy = FaultProxy(target_port=base).start()
    try:
        with deployment(tmp / "var", base_port=base, analyzer_url=proxy.url) as deployed:
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
        "bad network shuffler → analyzer", "SQLite", summary, recovered, seen | {"log": run.tail()}
    )


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
        CrashChain(processes[n], ANALYZER_POINTS if n == "analyzer" else SHUFFLER_POINTS).start()
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
