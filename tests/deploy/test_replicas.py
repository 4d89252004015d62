"""docker-compose.yml's ``replicas`` profile on a real Docker engine (issue 17, item 3).

Added to the running deployment (the session's ``stack``): a second process of each shuffler
trust domain (shuffler-<i>-r2: that domain's keys and published volumes, secrets and database
network) and one HAProxy per domain (deploy/haproxy/<domain>.cfg, generated from ``esa up
--replicas``'s configuration; health checks on /readyz), devices told the HAProxy URLs
(ESA_SHUFFLER_URL_TEMPLATE: every shuffler process, recreated with the template, vouches for
its HAProxy's URL in its own signed descriptor and publishes it) and the analyzer restarted to
take the new descriptors at once and serve them. Then
``esa demo`` (500 devices, one channel the other tests do not use) through HAProxy while one
replica's process is SIGKILLed from the host: the run certifies ε, the restart policy brings
the replica back, both processes of an untouched domain acknowledged contributions, and
conservation holds (acknowledged = forwarded + deleted + held; the analyzer received what
was forwarded and the release counts it). With the ``monitoring`` profile up as well (in the
session's stack test_monitoring.py started Prometheus first), Prometheus scrapes each
shuffler-<i>-r2 too, found through DNS (deploy/prometheus/prometheus.yml), labelled as a
process of its trust domain and up (its /metrics answered with the credential).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from common.collection import verify_collection
from tests.deploy.stack import PROJECT, PUBLISHED, ROOT, SERVED, Stack

pytestmark = pytest.mark.deploy

CHANNEL = "picture"  # k-RAPPOR as homepage (one contribution per device), unused elsewhere
DEVICES = 500
RATE = 40  # contributions/s in all: ~12 s of sending, long enough to kill a replica mid-run
REPORT = "/var/esa-reports/replicas.json"
PROMETHEUS_API = "http://127.0.0.1:9090/api/v1"
TEMPLATE = "http://shuffler-{i}-lb:{port}"
DOMAINS = ("shuffler-1", "shuffler-2", "shuffler-3")
REPLICAS = tuple(f"{d}-r2" for d in DOMAINS)
BALANCERS = tuple(f"{d}-lb" for d in DOMAINS)
KILLED = "shuffler-2-r2"
#: One process's /metrics, asked in its container with its trust domain's metrics token (the
#: Docker secret its ESA_SHUFFLER_METRICS_TOKEN_FILE names).
METRICS = (
    "import os, urllib.request as u; t = open(os.environ['ESA_SHUFFLER_METRICS_TOKEN_FILE'])"
    ".read().strip(); print(u.urlopen(u.Request('http://127.0.0.1:{port}/metrics',"
    " headers={{'Authorization': 'Bearer ' + t}}), timeout=5).read().decode())"
)


def _received(stack: Stack, service: str, port: int) -> int:
    """esa_shuffler_contributions_received of one process (its own counter, not the domain's)."""
    text = stack.exec(service, "python", "-c", METRICS.format(port=port))
    line = next(x for x in text.splitlines() if x.startswith("esa_shuffler_contributions_received"))
    return int(float(line.split()[-1]))


def _loadgen(stack: Stack, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    args = ["demo", "--analyzer-url", "http://analyzer:8100", "--trust", PUBLISHED]
    args += [
        "--keys",
        "/run/secrets",
        "--report",
        "/var/esa-reports/replicas.html",
        "--json",
        REPORT,
    ]
    args += ["--devices", str(DEVICES), "--channel", CHANNEL, "--rate", str(RATE)]
    command = [*stack.command, "-p", PROJECT, "--profile", "loadgen", "run", "--rm", "--no-deps"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*command, "-T", "loadgen", *args], cwd=ROOT, env=env, stdout=out, stderr=out
        )


def _prometheus_scrapes_the_replicas(stack: Stack, timeout: float = 90) -> None:
    """Prometheus (when the monitoring profile is up) has each -r2 process as an up target
    of the ``shuffler`` job, named and labelled as its trust domain's (DNS discovery every
    30 s, a scrape every 10 s), and holds its counters."""
    if not stack.container("prometheus"):
        return  # this file alone: the monitoring profile is not up in this stack
    want = {f"{d}-r2:{8100 + i}": d for i, d in enumerate(DOMAINS, start=1)}
    deadline, found = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        answer = httpx.get(f"{PROMETHEUS_API}/targets", params={"state": "active"}, timeout=10)
        targets = answer.raise_for_status().json()["data"]["activeTargets"]
        found = {t["labels"]["instance"]: t for t in targets if t["labels"]["instance"] in want}
        if set(found) == set(want) and all(t["health"] == "up" for t in found.values()):
            break
        time.sleep(3)
    else:
        raise AssertionError(f"Prometheus does not scrape every replica: {found}")
    for instance, domain in want.items():
        labels = found[instance]["labels"]
        assert labels["job"] == "shuffler" and labels["trust_domain"] == domain, labels
        assert labels["service"] == f"{domain}-r2", labels
    query = 'esa_shuffler_contributions_received_total{service=~"shuffler-.-r2"}'
    answer = httpx.get(f"{PROMETHEUS_API}/query", params={"query": query}, timeout=10)
    result = answer.raise_for_status().json()["data"]["result"]
    assert {r["metric"]["instance"] for r in result} == set(want), result


def _up_with_replicas(stack: Stack) -> dict[str, str]:
    env = {**stack.env, "ESA_SHUFFLER_URL_TEMPLATE": TEMPLATE}
    stack.run("--profile", "replicas", "build", BALANCERS[0], timeout=600, env=env)
    stack.run("--profile", "replicas", "up", "-d", timeout=600, env=env)
    # docker-compose 1.29 recreates the analyzer after the shufflers it depends on; v2 does
    # not: the restart takes the descriptors they just published at once (else within the
    # analyzer's descriptor refresh, a minute).
    stack.run("restart", "analyzer", timeout=120, env=env)
    stack.wait_healthy(timeout=240, services=(*SERVED, *REPLICAS, *BALANCERS))
    stack.wait_config()  # the restarted analyzer has every descriptor again, through HAProxy
    return env


def _own_url(stack: Stack, service: str, port: int) -> str:
    """The URL one process vouches for in the descriptor it signs (asked in its container)."""
    code = (
        "import json, urllib.request as u; print(json.load(u.urlopen("
        f"'http://127.0.0.1:{port}/v1/descriptor', timeout=5))['descriptor']['url'])"
    )
    return stack.exec(service, "python", "-c", code).strip()


def test_replicas_behind_haproxy_survive_a_kill_and_conserve(stack: Stack, tmp_path: Path) -> None:
    env = _up_with_replicas(stack)
    document = httpx.get("http://127.0.0.1:8100/v1/config", timeout=10).raise_for_status().json()
    config = verify_collection(document, stack.trust(), time.time())  # as the devices will
    want = [f"http://{d}-lb:{8100 + i}" for i, d in enumerate(DOMAINS, start=1)]
    assert [s.url for s in config.shufflers] == want
    for i, domain in enumerate(DOMAINS, start=1):  # both processes of each domain vouch for it
        for service in (domain, f"{domain}-r2"):
            assert _own_url(stack, service, 8100 + i) == want[i - 1], service
    for i in (1, 2, 3):  # HAProxy answers for its domain from the host too
        assert httpx.get(f"http://127.0.0.1:{8110 + i}/readyz", timeout=5).status_code == 200
    before = stack.restarts(KILLED)
    log = tmp_path / "loadgen.log"
    loadgen = _loadgen(stack, env, log)
    try:
        deadline = time.monotonic() + 240
        query = f"SELECT count(*) FROM contributions WHERE channel_id = '{CHANNEL}'"
        while stack.sql("shuffler-2", query) < 20:  # acknowledged ones, mid-run
            assert loadgen.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        os.kill(int(stack.state(KILLED)["Pid"]), 9)  # type: ignore[call-overload]
        assert loadgen.wait(timeout=300) == 0, log.read_text()
    finally:
        if loadgen.poll() is None:
            loadgen.kill()
    assert stack.restarts(KILLED) > before  # restart: unless-stopped brought it back
    stack.wait_healthy(timeout=120, services=(*SERVED, *REPLICAS))
    body = stack.run(
        "--profile", "loadgen", "run", "--rm", "--no-deps", "-T", "--entrypoint", "cat",
        "loadgen", REPORT, env=env,
    )  # fmt: skip
    (result,) = json.loads(body)["channels"]
    assert result["channel_id"] == CHANNEL and result["devices"] == DEVICES
    assert result["central_eps"] is not None and 0 < result["central_eps"] < 10
    # HAProxy spread the clients of an untouched domain over both of its processes.
    for domain, port in (("shuffler-1", 8101), ("shuffler-3", 8103)):
        assert _received(stack, domain, port) > 0, domain
        assert _received(stack, f"{domain}-r2", port) > 0, domain
    shuffled, received = stack.conservation(CHANNEL)
    assert received == result["n"] > 0
    assert result["delivered"] <= shuffled <= DEVICES, (result, shuffled)
    _prometheus_scrapes_the_replicas(stack)
