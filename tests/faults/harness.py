"""What every fault of issue 49 runs under: a deployment of real processes (the launcher's,
as ``esa up`` starts them), a verified ``esa loadtest`` against it as a subprocess, and the
row of docs/reliability.md its result makes.

The tests in this folder run each fault briefly; ``benchmarks/faults.py`` runs the same
scenarios longer (:class:`Load`) and writes the table. The load test's own verification is
the judge: acknowledged = received at the analyzer + deleted + held, nothing counted twice.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from common.wire import ChannelConfig
from services.cli import launcher
from services.tools.credentials import Credentials
from services.tools.loadtest import verify
from tests.support import LOADTEST_PAGES, TEST_SHUFFLER_SETTINGS, ServiceProcess, end_process

#: A k-RR channel of 3-second epochs: a fault of several seconds spans several epochs.
TICKS = LOADTEST_PAGES.model_copy(update={"id": "ticks", "epoch_seconds": 3})


@dataclass(frozen=True)
class Load:
    """The load a fault runs under: ``devices`` each sending once per epoch, ``rate``
    contributions/s offered for ``seconds`` (``esa loadtest --devices --rate --duration``)."""

    devices: int = 300
    rate: float = 100.0
    seconds: float = 24.0


@dataclass
class Deployed:
    """An analyzer and its shufflers started from ``var`` (each party its own tokens)."""

    var: Path
    analyzer: ServiceProcess
    shufflers: list[ServiceProcess]

    def tokens(self) -> Credentials:
        """Every shuffler's own admin and metrics tokens, by URL."""
        return Credentials(folder=self.var / "keys").for_parties(
            {s.spec.name: s.url for s in self.shufflers}
        )

    def unforwarded(self) -> float:
        """Parts batched at the shufflers and not yet acknowledged by the analyzer."""
        state = verify.shuffler_state([s.url for s in self.shufflers], self.tokens())
        return sum(s["in_batches_unforwarded"] for s in state.values())


@contextmanager
def deployment(
    var: Path,
    channel: ChannelConfig = TICKS,
    shufflers: int = 2,
    *,
    base_port: int | None = None,
    analyzer_url: str | None = None,
    databases: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
    env: Mapping[str, Mapping[str, str]] | None = None,
    channels: Sequence[ChannelConfig] = (),
    public_urls: Mapping[str, str] | None = None,
) -> Iterator[Deployed]:
    """``esa up`` on free ports (or from ``base_port``; SQLite), every service started at
    once, shufflers batching fast; ``analyzer_url``: where the shufflers reach the analyzer
    (a fault proxy); ``databases``: a service's database URL by name (``shuffler-1``:
    PostgreSQL of the test's own cluster, a file on a tmpfs); ``overrides``: more settings;
    ``env``: more environment of one process by name (``shuffler-1``: :func:`faketime`,
    ``ESA_FAILPOINTS`` armed in one);
    ``channels``: more channels than ``channel``; ``public_urls``: where devices reach a
    shuffler, by name (a fault proxy in front of it: the registry's URL and the one its
    descriptor vouches for)."""
    base = base_port or launcher.free_base_port(shufflers + 1)
    specs = launcher.prepare(
        var,
        shufflers,
        base,
        analyzer_url=analyzer_url,
        channels=[channel, *channels],
        overrides={**TEST_SHUFFLER_SETTINGS, **(overrides or {})},
    )
    specs = [_with_database(spec, (databases or {}).get(spec.name)) for spec in specs]
    specs = [replace(s, env={**s.env, **(env or {}).get(s.name, {})}) for s in specs]
    specs = _with_public_urls(var, specs, public_urls or {})
    started = launcher.start_all(specs, var / "logs", timeout=120)  # together: faster
    processes = [
        ServiceProcess(spec, service.log or var / "logs", service)
        for spec, service in zip(specs, started, strict=True)
    ]
    try:
        launcher.wait_config(started[0], 60)
        yield Deployed(var, processes[0], processes[1:])
    finally:
        stop_loads()
        for process in reversed(processes):
            process.stop()


#: Debian's libfaketime (package ``faketime``): preloaded, it moves one process's clock.
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def faketime(seconds: float) -> dict[str, str]:
    """The environment that runs a process with its wall clock ``seconds`` ahead (behind,
    negative) of the machine's: libfaketime preloaded, ``FAKETIME="+90s"``; its monotonic
    clock left alone (``FAKETIME_DONT_FAKE_MONOTONIC``: timeouts and asyncio's loop keep
    real time, as on a machine whose wall clock alone is off). Python's ``time.time()`` goes
    through ``clock_gettime(CLOCK_REALTIME)``, which the library moves."""
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{seconds:+g}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }


def _with_database(spec: launcher.ServiceSpec, url: str | None) -> launcher.ServiceSpec:
    if url is None:
        return spec
    key = "ESA_ANALYZER_DATABASE_URL" if spec.name == "analyzer" else "ESA_SHUFFLER_DATABASE_URL"
    return replace(spec, env={**spec.env, key: url})


def _with_public_urls(
    var: Path, specs: list[launcher.ServiceSpec], urls: Mapping[str, str]
) -> list[launcher.ServiceSpec]:
    """Register the shufflers of ``urls`` at those URLs (``var/shufflers.json``) and have
    their descriptors vouch for them (``ESA_SHUFFLER_PUBLIC_URL``)."""
    if not urls:
        return specs
    registry = json.loads((var / "shufflers.json").read_text())
    for entry in registry:
        entry["url"] = urls.get(entry["id"], entry["url"])
    (var / "shufflers.json").write_text(json.dumps(registry, indent=2))
    return [
        replace(spec, env={**spec.env, "ESA_SHUFFLER_PUBLIC_URL": urls[spec.name]})
        if spec.name in urls
        else spec
        for spec in specs
    ]


@dataclass
class LoadRun:
    """``esa loadtest`` against the deployment of ``var`` (its trust file and key folder)
    whose analyzer is at ``analyzer_url``, verified with the parties' own tokens, as a
    subprocess; its log is read as it comes (:meth:`wait_running`, :meth:`wait_for`)."""

    var: Path
    analyzer_url: str
    out: Path
    load: Load
    channel: str = TICKS.id
    #: More ``esa loadtest`` arguments (``--channel``, ``--clock-offset``, ``--expect-refusal``).
    extra: tuple[str, ...] = ()
    #: How long verification waits for every batch to reach the analyzer and be opened.
    drain_timeout: float = 120.0
    log: list[str] = field(default_factory=list)
    _running: threading.Event = field(default_factory=threading.Event)
    _process: subprocess.Popen[str] | None = None
    _reader: threading.Thread | None = None

    @classmethod
    def against(
        cls,
        deployed: Deployed,
        out: Path,
        load: Load,
        channel: str = TICKS.id,
        extra: tuple[str, ...] = (),
    ) -> LoadRun:
        """A run against :class:`Deployed` (started: :meth:`start`)."""
        return cls(deployed.var, deployed.analyzer.url, out, load, channel, extra)

    def start(self) -> LoadRun:
        var = self.var
        command = [
            sys.executable, "-m", "services.cli", "loadtest",
            "--analyzer-url", self.analyzer_url,
            "--trust", str(var / launcher.TRUST_FILE), "--keys", str(var / "keys"),
            "--out", str(self.out), "--no-live", "--drain-timeout", str(self.drain_timeout),
            "--channel", self.channel, "--devices", str(self.load.devices),
            "--rate", str(self.load.rate), "--duration", str(self.load.seconds), *self.extra,
        ]  # fmt: skip
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        _RUNNING.add(self._process)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self.log.append(line)
            if " run: " in f" {line}":  # "[hh:mm:ss] run: N contributions prepared"
                self._running.set()

    def wait_running(self, timeout: float = 120.0) -> float:
        """Block until the run phase has begun (sealing done); the monotonic time then."""
        if not self._running.wait(timeout):
            raise AssertionError("the load test never began its run:\n" + self.tail())
        return time.monotonic()

    def wait_for(self, text: str, timeout: float) -> None:
        """Block until a line of the run's log holds ``text``."""
        start = time.monotonic()
        while not any(text in line for line in list(self.log)):
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{text!r} never in the load test's log:\n{self.tail()}")
            time.sleep(0.1)

    def finish(self, timeout: float = 300.0) -> dict[str, Any]:
        """Wait for the end; ``loadtest.json`` (run and verification), with ``returncode``."""
        assert self._process is not None and self._reader is not None
        code = self._process.wait(timeout)
        _RUNNING.discard(self._process)
        self._reader.join(10)
        found = self.out / "loadtest.json"
        if not found.exists():
            raise AssertionError(f"no loadtest.json (exit {code}):\n{self.tail()}")
        summary: dict[str, Any] = json.loads(found.read_text())
        summary["returncode"] = code
        return summary

    def tail(self, chars: int = 4000) -> str:
        return "".join(self.log)[-chars:]


#: Load tests started and not finished: stopped by :func:`stop_loads` however a test ends.
_RUNNING: set[subprocess.Popen[str]] = set()


def stop_loads() -> None:
    """SIGTERM every load test still running (it stops cleanly), SIGKILL after 30 s."""
    for process in list(_RUNNING):
        end_process(process)
        _RUNNING.discard(process)


def time_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> float:
    """Seconds until ``predicate`` holds (an error while asking counts as not yet).

    Raises:
        AssertionError: not within ``timeout``.
    """
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except (httpx.HTTPError, verify.VerifyError):
            pass
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def assert_conserved(summary: Mapping[str, Any], log: str) -> None:
    """The load test passed its own verification: everything it sent was delivered,
    acknowledged = received + deleted + held, nothing lost, nothing counted twice."""
    check = summary["verification"]
    totals = check["conservation"]["totals"]
    assert summary["returncode"] == 0, log
    assert check["problems"] == [], check["problems"]
    assert totals["lost"] == 0 and totals["purged_late"] == 0, totals
    assert totals["shufflers_acknowledged"] == totals["acknowledged"] > 0, totals
    run = summary["run"]
    assert run["never_delivered"] == 0 and run["accepted"] == run["offered"], run


@dataclass(frozen=True)
class Row:
    """One line of docs/reliability.md's table."""

    fault: str
    backend: str
    summary: Mapping[str, Any]
    recovered_seconds: float
    #: What the test saw during the fault (e.g. parts held, ``/readyz`` answers).
    seen: Mapping[str, Any] = field(default_factory=dict)

    def cells(self) -> list[str]:
        run, check = self.summary["run"], self.summary["verification"]
        totals = check["conservation"]["totals"]
        refused = ", ".join(f"{k}: {v:,}" for k, v in run["retried"].items())
        never = dict(run.get("expected_refusals", {}))
        for group in run.get("clocks", {}).values():
            for code, n in group["refused"].items():
                never[code] = never.get(code, 0) + n
        kept = ", ".join(f"{k}: {v:,} (refused for good)" for k, v in never.items())
        refused = ", ".join(x for x in (refused, kept) if x) or "none"
        broken = sum(v for k, v in run["errors"].items() if not k.isdigit())
        if broken:  # transport errors: every one sent again (409 after a lost 202: stored)
            stored = run.get("recovered", 0)
            refused += f"; {broken:,} broken connections sent again ({stored:,} had been stored)"
        verdict = "" if self.summary.get("returncode") == 0 else " (verification FAILED)"
        return [
            self.fault + verdict,
            self.backend,
            f"{run['offered_per_s']:,.0f}/s × {run['seconds']:.0f} s",
            f"{run['accepted_per_s']:,.0f}/s",
            f"{totals['acknowledged']:,}",
            f"{max(totals['lost'], 0):,}",
            f"{max(-totals['lost'], 0):,}",
            refused,
            "—" if math.isnan(self.recovered_seconds) else f"{self.recovered_seconds:.1f} s",
        ]


HEADER = [
    "fault", "backend", "load offered", "load held", "acknowledged", "lost", "counted twice",
    "refusals by status (waited out)", "time to recover",
]  # fmt: skip


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)
