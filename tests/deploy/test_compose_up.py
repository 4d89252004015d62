"""docker-compose.yml on a real Docker engine (issue 16), as a new user runs it.

deploy/engine.sh installs Debian's docker.io, a compose and debootstrap when missing, starts a
plain ``dockerd`` when none answers, builds the stand-in base images when the pinned official
ones are not on the machine (no registry is contacted) and fills deploy/wheelhouse/. Then, with
every party's secrets made by deploy/party_secrets.py: ``build``, ``up -d``, every service
healthy, the signed config verified from the host with the keys the parties published
themselves (the analyzer's analyzer.pub and each shuffler's own signed descriptor, which
vouches for its in-network URL); the loadgen (``esa demo``, 500 devices on one channel, with
each party's own tokens) while shuffler-2's process is killed (SIGKILL from the host: a crash,
which the restart policy answers), its certified ε and estimates, conservation from each trust
domain's database (acknowledged = forwarded + removed by randomized deletion + held, and the
analyzer received what was forwarded); ``down`` and ``up`` keep keys and data. The ``stack``
fixture (conftest.py) is shared with test_monitoring.py, test_replicas.py and
test_trust_domains.py; ``down -v`` at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from common.collection import CollectionConfigError, TrustAnchors, verify_collection
from common.envelope import load_ed25519_public, public_bytes
from common.wire import b64
from tests.deploy.stack import DATABASES, PORTS, PROJECT, PUBLISHED, ROOT, Stack

pytestmark = pytest.mark.deploy

CHANNEL = "homepage"
DEVICES = 500
RATE = 25  # contributions/s in all
REPORT = "/var/esa-reports/demo.json"


def test_the_deployment_is_healthy_and_its_config_verifies_from_the_host(stack: Stack) -> None:
    for service, port in PORTS.items():
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
        assert stack.state(service)["Running"] is True
    trust = stack.trust()  # what a device pins: one key per party, each published by its party
    key = stack.exec("analyzer", "cat", f"{PUBLISHED}/analyzer/analyzer.pub").strip()
    assert key == b64(public_bytes(trust.analyzer))
    document = stack.wait_config()
    config = verify_collection(document, trust, time.time())
    shufflers = {s: p for s, p in PORTS.items() if s != "analyzer"}
    assert [s.url for s in config.shufflers] == [f"http://{s}:{p}" for s, p in shufflers.items()]
    assert CHANNEL in {c.id for c in config.channels}
    # Each descriptor in the config is the one its shuffler signs and serves itself.
    for info, (name, port) in zip(config.shufflers, shufflers.items(), strict=True):
        own = httpx.get(f"http://127.0.0.1:{port}/v1/descriptor", timeout=10).json()
        assert own["descriptor"]["id"] == info.id == name
        assert own["descriptor"]["url"] == info.url
        assert own["descriptor"]["keys"][0]["public_key"] == info.public_key
    other = load_ed25519_public(os.urandom(32))  # a key that signed nothing here
    with pytest.raises(CollectionConfigError):  # another analyzer key pinned
        verify_collection(document, TrustAnchors(other, trust.shufflers), time.time())
    with pytest.raises(CollectionConfigError, match="shuffler-2"):  # another shuffler key
        pinned = {**trust.shufflers, "shuffler-2": other}
        verify_collection(document, TrustAnchors(trust.analyzer, pinned), time.time())
    # The services run as the image's non-root user, with the production settings.
    assert stack.exec("shuffler-1", "id", "-un").strip() == "esa"
    for port in PORTS.values():  # every party's /metrics needs its own credential
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert metrics.status_code == 401, port  # a shuffler's exact counts are secret


def _loadgen(stack: Stack, log: Path) -> subprocess.Popen[bytes]:
    """The README's `run --rm --no-deps loadgen`, with a small population on one channel."""
    args = ["demo", "--analyzer-url", "http://analyzer:8100", "--trust", PUBLISHED]
    args += [
        "--keys",
        "/run/secrets",
        "--report",
        "/var/esa-reports/demo-report.html",
        "--json",
        REPORT,
    ]
    args += ["--devices", str(DEVICES), "--channel", CHANNEL]
    # Paced (~20 s of sending) so the test can kill a shuffler mid-run: unpaced, 500
    # contributions take well under a second and the kill raced the end of the run.
    args += ["--rate", str(RATE)]
    command = [*stack.command, "-p", PROJECT, "--profile", "loadgen", "run", "--rm", "--no-deps"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*command, "-T", "loadgen", *args], cwd=ROOT, env=stack.env, stdout=out, stderr=out
        )


def test_loadgen_certifies_epsilon_while_a_shuffler_crashes_and_restarts(
    stack: Stack, tmp_path: Path
) -> None:
    before = stack.restarts("shuffler-2")
    log = tmp_path / "loadgen.log"
    loadgen = _loadgen(stack, log)
    try:
        deadline = time.monotonic() + 240
        query = f"SELECT count(*) FROM contributions WHERE channel_id = '{CHANNEL}'"
        while stack.sql("shuffler-2", query) < 20:  # acknowledged ones, mid-run
            assert loadgen.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        os.kill(int(stack.state("shuffler-2")["Pid"]), 9)  # type: ignore[call-overload]
        assert loadgen.wait(timeout=300) == 0, log.read_text()
    finally:
        if loadgen.poll() is None:
            loadgen.kill()
    output = log.read_text()
    assert stack.restarts("shuffler-2") > before  # restart: unless-stopped brought it back
    stack.wait_healthy(timeout=120)
    body = stack.run(
        "--profile",
        "loadgen",
        "run",
        "--rm",
        "--no-deps",
        "-T",
        "--entrypoint",
        "cat",
        "loadgen",
        REPORT,
    )
    (result,) = json.loads(body)["channels"]
    assert result["channel_id"] == CHANNEL and result["devices"] == DEVICES
    assert result["central_eps"] is not None and 0 < result["central_eps"] < 10
    assert f"{result['central_eps']:.3f}" in output  # printed, not only in the JSON
    assert result["inside"] >= len(result["checked"]) / 2 > 0
    assert "MPLCONFIGDIR" not in output and "temporary cache" not in output  # writable home
    assert output.rstrip().endswith("dashboard from the host: http://127.0.0.1:8100/"), output
    leaked = [name for name, value in stack.secrets.items() if value in output]
    assert not leaked, f"the loadgen printed {leaked}"
    shuffled, received = stack.conservation(CHANNEL)
    assert received == result["n"] > 0  # the release counts what the analyzer received
    # Nothing acknowledged lost: every acknowledged contribution was forwarded, removed by
    # randomized deletion or held; one acknowledged by a shuffler that died before answering
    # is retried by its device and stored once (one per client, channel and epoch).
    assert result["delivered"] <= shuffled <= DEVICES, (result, shuffled)
    for server in DATABASES:
        postgres_log = stack.run("logs", "--no-color", server)
        assert "does not exist" not in postgres_log, server  # no query before the migrations


def test_down_and_up_keep_keys_and_data(stack: Stack) -> None:
    published = f"{PUBLISHED}/analyzer/analyzer.pub"
    key = stack.exec("analyzer", "cat", published)
    trust = stack.trust().to_json()
    received = stack.sql("analyzer", "SELECT count(*) FROM receipts")
    # every profile's containers and the project's networks gone (Stack.down): one left on the
    # fixed-subnet network would keep it, and `up` would then fail to create its subnet again
    stack.down()
    stack.run("up", "-d", timeout=300)
    stack.wait_healthy()
    # Every service found its keys in its own volume and published the same public keys again.
    assert stack.exec("analyzer", "cat", published) == key
    assert stack.trust().to_json() == trust  # devices keep working with the keys they pin
    verify_collection(stack.wait_config(), stack.trust(), time.time())
    assert stack.sql("analyzer", "SELECT count(*) FROM receipts") == received > 0
    privacy = httpx.get(f"http://127.0.0.1:8100/v1/channels/{CHANNEL}/privacy", timeout=10)
    assert privacy.status_code == 200 and privacy.json()["epochs"], privacy.text
