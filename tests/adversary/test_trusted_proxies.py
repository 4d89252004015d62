"""Attack 6: enrolment behind a proxy that is not on loopback. The proxy runs in a network
namespace of its own joined to this host by a veth pair (10.213.<n>.2 → the shuffler on
10.213.<n>.1; nothing leaves the machine). The shuffler trusts ``X-Forwarded-For`` from that
proxy only (``trusted_proxies``), so its enrolment limit counts per device address behind it;
from any other peer the header is ignored (runtime/proxies.py; docs/operations.md, "Trusted
proxies")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli import launcher

from ..support import SMALL_CHANNEL, free_port, shuffler_process, wait_until

pytestmark = [pytest.mark.system, pytest.mark.slow]

#: What the proxy sends for each device: one request per X-Forwarded-For value, statuses out.
PROXY = """
import json, sys, httpx
url, sources = sys.argv[1], sys.argv[2:]
print(json.dumps([httpx.post(url, headers={"X-Forwarded-For": s}, timeout=10).status_code
                  for s in sources]))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace holding the proxy's address: (name, host address, proxy address)."""
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    n = os.getpid() % 250 + 1
    name, host_end, proxy_end = f"esa-px{n}", f"epx{n}h", f"epx{n}p"
    host, proxy = f"10.213.{n}.1", f"10.213.{n}.2"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", proxy_end)
        _ip("link", "set", proxy_end, "netns", name)
        _ip("addr", "add", f"{host}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{proxy}/30", "dev", proxy_end)
        _ip("netns", "exec", name, "ip", "link", "set", proxy_end, "up")
        yield name, host, proxy
    except subprocess.CalledProcessError as error:
        pytest.skip(f"no network namespace here: {error.stderr!r}")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, timeout=10)


def _through_proxy(namespace: str, url: str, sources: list[str]) -> list[int]:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", PROXY, url, *sources],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    statuses: list[int] = json.loads(done.stdout)
    return statuses


def test_the_enrolment_limit_is_per_device_behind_a_proxy_off_loopback(
    namespace: tuple[str, str, str], tmp_path: Path
) -> None:
    name, host, proxy = namespace
    process = shuffler_process(
        tmp_path,
        "shuffler-1",
        [SMALL_CHANNEL],
        enroll_per_minute="6",  # a burst of one enrolment per address
        host=host,
        port=str(free_port()),
        trusted_proxies=proxy,
    )
    url = f"http://{host}:{process.env['ESA_SHUFFLER_PORT']}"
    service = launcher.start(process.spec, process.log_path)
    try:
        wait_until(lambda: _ready(url), 60)
        behind = _through_proxy(name, url + "/v1/enroll", ["203.0.113.7"] * 2 + ["203.0.113.8"])
        direct = [  # a peer that is not the proxy: its header names nobody
            httpx.post(url + "/v1/enroll", headers={"X-Forwarded-For": f"198.51.100.{i}"})
            for i in (1, 2)
        ]
    finally:
        launcher.stop([service])
    print(
        f"ATTACK 6 enrolment through a proxy at {proxy} (not loopback): device A "
        f"{behind[:2]}, device B after A spent its limit {behind[2]}; honest control, a "
        f"direct peer naming two addresses in X-Forwarded-For: {[r.status_code for r in direct]}"
    )
    assert behind == [200, 429, 200]  # per device behind the proxy, not one shared bucket
    assert [r.status_code for r in direct] == [200, 429]  # its header ignored: one address


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
