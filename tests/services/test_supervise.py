"""``esa up`` supervises what it started (``launcher.serve_forever``), with real processes.

* 2 shuffler replicas behind HAProxy on PostgreSQL: one replica SIGKILLed is restarted on its
  port while ``esa up`` keeps running and HAProxy keeps answering; the other one killed again
  and again as soon as it is back (a crash loop) makes ``esa up`` give up, stop everything and
  exit non-zero saying so.
* A single-process layout (SQLite): a killed shuffler has no sibling to stand in for it, so
  ``esa up`` stops everything and exits non-zero, as before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from services.cli import launcher

from ..support import wait_until

pytestmark = pytest.mark.system  # starts real processes

READY_SECONDS = 60.0


class EsaUp:
    """An ``esa up`` subprocess and everything it printed (stdout and stderr, read by a thread
    so that the pipe never fills)."""

    def __init__(self, var: Path, args: list[str]) -> None:
        self.var = var
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--var", str(var), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self) -> None:
        """Until it printed its dashboard line (every service ready)."""
        deadline = time.monotonic() + READY_SECONDS
        while not any(line.startswith("dashboard") for line in self.lines):
            assert self.process.poll() is None, f"esa up exited:\n{self.output}"
            assert time.monotonic() < deadline, f"esa up not ready:\n{self.output}"
            time.sleep(0.1)

    def child_on(self, variable: str, port: int) -> int | None:
        """The pid of its direct child started with ``variable=port`` in its environment."""
        marker = f"{variable}={port}\0".encode()
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                if parent == self.process.pid and marker in (entry / "environ").read_bytes():
                    return int(entry.name)
            except (OSError, ValueError, IndexError):
                continue
        return None

    def leftovers(self) -> list[int]:
        """Processes it started that still run: their environment or command line names
        ``var`` (the services' key and database paths, HAProxy's configuration)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in (os.getpid(), self.process.pid):
                continue
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                text = (entry / "environ").read_bytes() + (entry / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if state != "Z" and str(self.var).encode() in text:
                found.append(int(entry.name))
        return found


@contextmanager
def esa_up(var: Path, args: list[str]) -> Iterator[EsaUp]:
    """``esa up`` with ``args``; afterwards it and every process it started are gone."""
    up = EsaUp(var, args)
    try:
        yield up
    finally:
        if up.process.poll() is None:
            up.process.send_signal(signal.SIGTERM)
            try:
                up.process.wait(30)
            except subprocess.TimeoutExpired:
                up.process.kill()
                up.process.wait()
        for pid in up.leftovers():  # only if esa up failed to stop them
            os.kill(pid, signal.SIGKILL)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_replica_is_restarted_and_a_crash_loop_stops_everything(
    tmp_path: Path, postgres_template: str
) -> None:
    base = launcher.free_base_port(launcher.scaled_ports(1, 2, 1))
    # base: HAProxy -> analyzer.w1 (base + 2); base + 1: HAProxy -> shuffler-1.r1, .r2 (+3, +4)
    lb, r1, r2 = base + 1, base + 3, base + 4
    args = ["--shufflers", "1", "--replicas", "2", "--base-port", str(base)]
    args += ["--database-url-template", postgres_template]
    with esa_up(tmp_path / "var", args) as up:
        up.wait_ready()
        first = up.child_on("ESA_SHUFFLER_PORT", r1)
        assert first is not None, up.output
        _kill(first)
        wait_until(lambda: "shuffler-1.r1 is ready again" in up.output, timeout=30)
        assert "shuffler-1.r1 exited (code -9); restarting it (HAProxy sends" in up.output
        assert up.child_on("ESA_SHUFFLER_PORT", r1) not in (None, first)
        assert _ready(r1) and up.process.poll() is None
        assert httpx.get(f"http://127.0.0.1:{lb}/v1/config", timeout=5).status_code == 200
        # Kill shuffler-1.r2 each time it is started again: the 6th death in 60 s gives up.
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        while up.process.poll() is None and time.monotonic() < deadline:
            pid = up.child_on("ESA_SHUFFLER_PORT", r2)
            if pid is not None and pid not in killed:
                _kill(pid)
                killed.add(pid)
            time.sleep(0.05)
        assert up.process.wait(20) != 0, up.output
    assert "shuffler-1.r2 died 6 times within 60 s (a crash loop" in up.output, up.output
    assert len(killed) == 6 and up.output.count("shuffler-1.r2 exited (code -9)") == 5
    wait_until(lambda: not up.leftovers(), timeout=15)
    assert all(launcher.port_free(port) for port in range(base, base + 5))


def test_a_process_without_siblings_still_stops_everything(tmp_path: Path) -> None:
    base = launcher.free_base_port(launcher.scaled_ports(1, 1, 1))
    with esa_up(tmp_path / "var", ["--shufflers", "1", "--base-port", str(base)]) as up:
        up.wait_ready()
        pid = up.child_on("ESA_SHUFFLER_PORT", base + 1)
        assert pid is not None, up.output
        _kill(pid)
        assert up.process.wait(20) != 0
    assert "shuffler-1 stopped unexpectedly (exit code -9)" in up.output, up.output
    assert "restarting" not in up.output
    wait_until(lambda: not up.leftovers(), timeout=15)
    assert launcher.port_free(base)


def _sleeper(name: str) -> launcher.Service:
    """A real process standing in for a service named ``name`` (never restarted here)."""
    process = subprocess.Popen(["sleep", "60"])
    spec = launcher.ServiceSpec(name, ("shuffler", "serve"), {}, 9)
    return launcher.Service(name=name, url=spec.url, process=process, log=None, spec=spec)


def test_haproxy_or_a_process_with_no_sibling_dying_cannot_be_helped() -> None:
    # --replicas 2, --analyzer-workers 1: analyzer.w1 has no sibling, the replicas have one.
    names = ["analyzer.w1", "shuffler-1.r1", "shuffler-1.r2", "haproxy:analyzer"]
    services = [_sleeper(name) for name in names]
    try:
        by_name = {service.name: service for service in services}
        assert [s.name for s in launcher.siblings(by_name["shuffler-1.r1"], services)] == [
            "shuffler-1.r2"
        ]
        assert launcher.siblings(by_name["analyzer.w1"], services) == []
        assert launcher.siblings(by_name["haproxy:analyzer"], services) == []
        for name in ("haproxy:analyzer", "analyzer.w1"):
            supervisor = launcher.Supervisor(services=services, report=print)
            supervisor.check()  # all up: nothing to do
            by_name[name].kill()
            try:
                supervisor.check()
            except launcher.LaunchError as error:
                assert f"{name} stopped unexpectedly (exit code -9)" in str(error)
            else:
                raise AssertionError(f"{name} died and the supervisor carried on")
            assert not supervisor.restarting
            by_name[name].process = subprocess.Popen(["sleep", "60"])
    finally:
        launcher.stop(services)
