"""Channels change while the deployment runs (real processes: an analyzer and 3 shufflers):
one added with ``esa channel add`` takes devices' reports to a release without any process
restarting; one retired mid-epoch takes its current epoch and refuses the next
(``409 channel_retired``); a device whose config predates either change recovers by itself."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from common.wire import MAX_EPOCH_SECONDS, ChannelConfig
from encoder_client import ChannelRetiredError, Client

from ..support import Deployment, close_epoch, start_deployment, wait_until

# Long epochs where a test spans seconds (no boundary is crossed: P < 1e-6 per run); a
# 12-second epoch where one must be. eps_cr, delta_cr: within every shuffler's floor for
# channels it adopts (min_crowd >= 10, eps_cr <= 2, delta_cr <= 1e-5), and an abort
# probability delta_cr / 4 per group that never matters.
HOME = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 10, "eps": 4.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=10,
    eps_cr=2.0,
    delta_cr=1e-7,
    max_fragments=10,
    payload_size=16,
    delta=1e-8,
)
SEARCH = HOME.model_copy(update={"id": "search", "title": "Searches, added at runtime"})
SHORT = HOME.model_copy(update={"id": "short", "epoch_seconds": 12})
ADMIN_TOKEN = "development"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    running = start_deployment(tmp_path_factory.mktemp("channels"), [HOME, SHORT])
    yield running
    running.stop()


def _client(deployment: Deployment, state: Path) -> Client:
    url = deployment.analyzer.url + "/v1/config"
    return Client(url, trust_file=deployment.trust_file, state_path=state, background=False)


def _esa(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _pids(deployment: Deployment) -> list[int]:
    processes = [deployment.analyzer, *deployment.shufflers]
    return [p.service.process.pid for p in processes if p.service is not None]


def test_a_channel_added_at_runtime_takes_reports_to_a_release(
    deployment: Deployment, tmp_path: Path
) -> None:
    before = _pids(deployment)
    stale = _client(deployment, tmp_path / "stale.db")  # its config predates the channel
    channel_file = tmp_path / "search.json"
    channel_file.write_text(SEARCH.model_dump_json())
    url = deployment.analyzer.url
    out = _esa("channel", "add", "--url", url, "--admin-token", ADMIN_TOKEN, str(channel_file))
    assert "search: added (config revision 1)" in out
    assert "search" in _esa("channel", "list", "--url", url)
    # Each device reports to one of the 3 shufflers: ~150 each, and fewer than 97 at one with
    # P < 1e-7 (Binomial(450, 1/3), 5.3 sd). Randomized deletion removes ln(2 / delta_cr) *
    # 2 / eps_cr ~ 17, more than 33 with P < 1e-7 (Laplace, scale 1): >= 64 kept, whose
    # fragments verify a crowd of ~40, far above min_crowd. With 150 devices a shuffler's
    # verified crowd fell below 10 in ~1 run in 10 and held its batch (no release to check).
    values = np.repeat(np.arange(10), [108, 90, 72, 54, 45, 36, 18, 12, 9, 6])
    clients = [stale] + [_client(deployment, tmp_path / f"d{i}.db") for i in range(1, values.size)]
    for client, value in zip(clients, values, strict=True):
        client.histogram("search").report(int(value))  # the stale one fetches the config first
    delivered = 0

    def flushed() -> bool:
        nonlocal delivered
        delivered += sum(client.flush() for client in clients)
        return delivered == values.size

    wait_until(flushed, timeout=30)  # a shuffler adopts the channel within a second
    for client in clients:
        client.close()
    epoch = int(time.time() // SEARCH.epoch_seconds)
    close_epoch(deployment, "search", epoch)
    estimate = f"{url}/v1/channels/search/estimate?epoch={epoch}"
    wait_until(lambda: httpx.get(estimate).status_code == 200, timeout=30)
    release = httpx.get(estimate).json()
    check = release["crowd_check"]
    assert check["verified"] <= release["n"] <= check["claimed"]  # fragments prove, claims held
    assert 0 < release["n"] <= values.size and release["certificate"]["eps"] < 10
    assert _pids(deployment) == before  # nothing restarted


def _early_in_an_epoch(seconds: int) -> None:
    """Wait until at most half a second has passed in an epoch of ``seconds``."""
    while time.time() % seconds > 0.5:
        time.sleep(0.05)


def test_a_retired_channel_takes_its_epoch_then_refuses_and_a_stale_device_recovers(
    deployment: Deployment, tmp_path: Path
) -> None:
    url = deployment.analyzer.url
    _early_in_an_epoch(SHORT.epoch_seconds)
    current = int(time.time() // SHORT.epoch_seconds)
    stale = _client(deployment, tmp_path / "stale.db")  # knows SHORT as live
    out = _esa("channel", "retire", "--url", url, "--admin-token", ADMIN_TOKEN, "short")
    # from the next epoch, or the one after if the retirement came within half an epoch of
    # its end (a loaded machine may take that long to run the command)
    first = int(out.rsplit("from epoch ", 1)[1].split()[0])
    assert first in (current + 1, current + 2), out
    on_time = _client(deployment, tmp_path / "on-time.db")
    on_time.histogram("short").report(3)  # an epoch before ``first`` is still taken
    assert on_time.flush() == 1
    wait_until(lambda: time.time() // SHORT.epoch_seconds >= first, timeout=30)
    stale.histogram("short").report(4)  # sealed with the old config, for the retired epoch
    assert stale.flush() == 0 and stale.state.outbox_size() == 0  # 409 channel_retired: dropped
    with pytest.raises(ChannelRetiredError, match=f"retired from epoch {first}"):
        stale.histogram("short").report(5)  # the config was fetched again first
    fresh = _client(deployment, tmp_path / "fresh.db")
    with pytest.raises(ChannelRetiredError):
        fresh.histogram("short").report(5)
    listed = json.loads(httpx.get(url + "/v1/channels").text)
    short = next(c for c in listed["channels"] if c["id"] == "short")
    assert short["retired_from_epoch"] == first
    assert httpx.get(url + "/v1/channels/short/privacy").status_code == 200
    for client in (stale, on_time, fresh):
        client.close()
