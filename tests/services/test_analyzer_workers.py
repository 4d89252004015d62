"""``esa up --analyzer-workers 2`` serves devices one deployment: whichever worker a device's
config request reaches (HAProxy spreads them), the config is one the device accepts.

Each worker fetches the shufflers' signed descriptors itself, and a shuffler signs a fresh
``issued_at`` on every fetch; a device refuses a descriptor older than one it accepted (the
rollback check). The workers keep the newest descriptor in their shared database and serve
that one, so a worker restarted after a crash (here worker 2, killed; ``esa up`` restarts it)
and fetching anew makes both serve its newer descriptor, and a device that took the config
from one worker takes it from the other too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from encoder_client import Client
from services.cli import launcher

from ..support import wait_until
from .test_supervise import esa_up

pytestmark = pytest.mark.system  # starts real processes


def _descriptor_issued_at(port: int) -> int:
    config = httpx.get(f"http://127.0.0.1:{port}/v1/config", timeout=10).json()["config"]
    (shuffler,) = config["shufflers"]
    return int(shuffler["descriptor"]["issued_at"])


def test_a_device_takes_the_config_from_either_analyzer_worker(
    tmp_path: Path, postgres_template: str
) -> None:
    base = launcher.free_base_port(launcher.scaled_ports(1, 1, 2))
    # base: HAProxy -> analyzer.w1 (base + 2), .w2 (base + 3); base + 1: shuffler-1.r1 (+4)
    w1, w2 = base + 2, base + 3
    var = tmp_path / "var"
    args = ["--shufflers", "1", "--analyzer-workers", "2", "--base-port", str(base)]
    args += ["--database-url-template", postgres_template]
    with esa_up(var, args) as up:
        up.wait_ready()
        time.sleep(1.1)  # the restarted worker's descriptor is issued in a later second
        pid = up.child_on("ESA_ANALYZER_PORT", w2)
        assert pid is not None, up.output
        up_to = _descriptor_issued_at(w1)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: "analyzer.w2 is ready again" in up.output, timeout=60)
        wait_until(lambda: _ready_config(w2), timeout=30)
        wait_until(lambda: _descriptor_issued_at(w2) > up_to, timeout=30)
        assert _descriptor_issued_at(w1) == _descriptor_issued_at(w2)
        trust, state = var / launcher.TRUST_FILE, tmp_path / "device.sqlite"

        def start(port: int) -> None:  # the app starts, its config request reaching ``port``
            url = f"http://127.0.0.1:{port}/v1/config"
            Client(url, trust_file=trust, state_path=state, background=False).close()

        start(w2)
        start(w1)


def _ready_config(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/config", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
