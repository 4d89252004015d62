"""Our commands stop cleanly on SIGTERM (``timeout``, systemd, ``docker stop``, a cancelled CI
job: sent to the command alone) and on Ctrl-C (SIGINT to the terminal's whole foreground
process group): each run below is stopped at a point where it has services, sealing workers
or a temporary folder, and must exit within a bound with 128 + the signal, one line saying
why and no traceback, leaving no process it started and no temporary folder behind.

One real run per case: ``esa up`` (Ctrl-C once its URLs are printed; SIGTERM:
tests/services/test_launcher.py), ``esa loadtest --up`` (Ctrl-C while its sealing workers
start, SIGTERM while it sends) and ``esa demo`` (SIGTERM while its own deployment is up and its
devices enroll; Ctrl-C while it keeps its deployment up: tests/e2e/test_demo.py). ``esa
audit`` starts no process of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from services.cli import launcher

from ..support import wait_until

pytestmark = pytest.mark.system  # starts real processes

#: Seconds a stopped command may take to exit: services get 10 s to stop before they are
#: killed (launcher.STOP_GRACE_SECONDS); a clean stop takes 1-3 s.
EXIT_BOUND = 20.0
#: Seconds a command may take to reach the point where it is stopped.
READY_SECONDS = 120.0


class Command:
    """``esa ARGS`` in a session of its own (as a shell runs a foreground job), with its
    TMPDIR in ``tmp``: every process it starts inherits that, which finds them all."""

    def __init__(self, args: list[str], tmp: Path) -> None:
        self.tmp = tmp
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmp), "COLUMNS": "200"},
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err)):
            threading.Thread(target=_collect, args=(stream, lines), daemon=True).start()

    @property
    def output(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + READY_SECONDS
        while not ready():
            assert self.process.poll() is None, f"exited before {what}:\n{self.output[-3000:]}"
            assert time.monotonic() < deadline, f"no {what}:\n{self.output[-3000:]}"
            time.sleep(0.1)

    def said(self, text: str) -> bool:
        return text in self.output

    def started(self) -> list[int]:
        """Every live process it started (its TMPDIR in their environment), itself left out."""
        marker = f"TMPDIR={self.tmp}\0".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in (os.getpid(), self.process.pid):
                continue
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
        return found

    def sealing_workers(self) -> int:
        """How many of its own children are multiprocessing workers (the sealing pool; the
        analyzer's opening workers are the analyzer's children)."""
        count = 0
        for pid in self.started():
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                spawned = b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            count += parent == self.process.pid and spawned
        return count

    def stop_with(self, signum: int) -> float:
        """Send ``signum`` as its sender would (Ctrl-C: to the whole foreground process
        group, as a terminal does; SIGTERM: to the command alone); seconds until it exited."""
        start = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        self.process.wait(EXIT_BOUND)
        return time.monotonic() - start


def _collect(stream: object, lines: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line)


@contextmanager
def command(args: list[str], tmp: Path) -> Iterator[Command]:
    """The command; afterwards it and whatever it left are gone, even if the test failed."""
    run = Command(args, tmp)
    try:
        yield run
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.process.wait()
        for pid in run.started():
            os.kill(pid, signal.SIGKILL)


def assert_stopped_cleanly(run: Command, name: str, signum: int, seconds: float) -> None:
    """Exit status 128 + signal within the bound, one line saying why, no traceback, nothing
    it started still running, no temporary folder of its own left."""
    text = run.output
    assert run.process.returncode == 128 + signum, f"{run.process.returncode}:\n{text[-3000:]}"
    assert seconds < EXIT_BOUND
    assert "Traceback" not in text, text[-5000:]
    said = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "SIGTERM"
    lines = [line for line in run.err if "stopped by" in line]
    assert len(lines) == 1 and f"{name} stopped by {said}" in lines[0], text[-3000:]
    wait_until(lambda: not run.started(), timeout=5)
    assert not list(run.tmp.glob("esa-*")), list(run.tmp.iterdir())


def test_esa_up_stops_every_service_on_ctrl_c(tmp_path: Path) -> None:
    base = launcher.free_base_port(2)
    args = ["up", "--var", str(tmp_path / "var"), "--shufflers", "1", "--base-port", str(base)]
    with command(args, tmp_path) as run:
        run.wait_for(lambda: run.said("dashboard"), "dashboard line")
        assert len(run.started()) >= 2  # the analyzer (and its opening workers), the shuffler
        seconds = run.stop_with(signal.SIGINT)
    assert_stopped_cleanly(run, "esa up", signal.SIGINT, seconds)
    assert launcher.port_free(base) and launcher.port_free(base + 1)


def test_loadtest_up_stops_on_ctrl_c_while_its_sealing_workers_start(tmp_path: Path) -> None:
    args = ["loadtest", "--up", "--channel", "homepage", "--devices", "20", "--no-live"]
    with command([*args, "--out", str(tmp_path / "out")], tmp_path) as run:
        run.wait_for(lambda: run.said("enrolled 20 devices"), "enrolment")
        assert run.sealing_workers() == 2
        seconds = run.stop_with(signal.SIGINT)
    assert_stopped_cleanly(run, "esa loadtest", signal.SIGINT, seconds)


def test_loadtest_up_stops_on_sigterm_while_it_sends(tmp_path: Path) -> None:
    args = ["loadtest", "--up", "--channel", "homepage", "--devices", "40", "--rate", "4"]
    with command([*args, "--no-live", "--out", str(tmp_path / "out")], tmp_path) as run:
        run.wait_for(lambda: run.said("run: 40 contributions prepared"), "the run")
        seconds = run.stop_with(signal.SIGTERM)
    assert_stopped_cleanly(run, "esa loadtest", signal.SIGTERM, seconds)
    assert "run finished" not in run.output  # stopped while sending


def test_demo_stops_its_own_deployment_on_sigterm(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{launcher.free_base_port(4)}"
    args = ["demo", "--devices", "500", "--channel", "homepage", "--analyzer-url", url]
    args += ["--report", str(tmp_path / "report.html"), "--exit"]
    with command(args, tmp_path) as run:
        run.wait_for(lambda: run.sealing_workers() == 2, "sealing workers")
        seconds = run.stop_with(signal.SIGTERM)
    assert_stopped_cleanly(run, "esa demo", signal.SIGTERM, seconds)
    assert not (tmp_path / "report.html").exists()
