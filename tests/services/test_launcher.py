"""``esa up``: starts everything healthy, refuses a taken port, leaves nothing behind on SIGTERM."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.launcher import DEFAULT_CHANNELS, port_free

from ..support import wait_until


def _base_port() -> int:
    for _ in range(100):
        base = random.randrange(20_000, 40_000)
        if all(port_free(base + i) for i in range(4)):
            return base
    raise RuntimeError("no free port range")


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_up_serves_every_mechanism_refuses_taken_ports_and_stops_cleanly(tmp_path: Path) -> None:
    var, base = tmp_path / "var", _base_port()
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--var",
        str(var),
        "--base-port",
        str(base),
    ]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout is not None
        lines = [first.stdout.readline() for _ in range(5)]
        assert lines[-1].startswith("dashboard"), lines
        channels = httpx.get(f"http://127.0.0.1:{base}/v1/channels").json()["channels"]
        assert {c["mechanism"] for c in channels} == {c.mechanism for c in DEFAULT_CHANNELS}
        for i in range(1, 4):
            assert httpx.get(f"http://127.0.0.1:{base + i}/readyz").status_code == 200
        assert oct((var / "keys" / "analyzer" / "hpke.pem").stat().st_mode & 0o777) == "0o600"
        second = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "already in use" in second.stderr
        assert len(_processes_mentioning(str(var))) == 4  # analyzer + 3 shufflers
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    wait_until(lambda: not _processes_mentioning(str(var)), timeout=20)
    assert all(port_free(base + i) for i in range(4))
    time.sleep(0.1)
