"""docker-compose.yml on a real Docker engine (issue 16), as a new user runs it.

deploy/engine.sh installs Debian's docker.io, a compose and debootstrap when missing, starts a
plain ``dockerd`` when none answers, builds the stand-in base images when the pinned official
ones are not on the machine (no registry is contacted) and fills deploy/wheelhouse/. Then, with
production secrets of its own: ``build``, ``up -d``, every service healthy, the signed config
verified from the host with the key ``init`` wrote; the loadgen (``esa demo``, 500 devices on
one channel) while shuffler-2's process is killed (SIGKILL from the host: a crash, which the
restart policy answers), its certified ε and estimates, conservation from the databases
(acknowledged = forwarded + removed by randomized deletion + held, and the analyzer received
what was forwarded); ``down`` and ``up`` keep keys and data; ``down -v`` at the end.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from common.collection import CollectionConfigError, verify_config
from common.envelope import load_ed25519_public
from common.wire import SignedConfig

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "esa-deploy-test"
PORTS = {"analyzer": 8100, "shuffler-1": 8101, "shuffler-2": 8102, "shuffler-3": 8103}
SERVED = ("postgres", *PORTS)
CHANNEL = "homepage"
DEVICES = 500
RATE = 25  # contributions/s in all
REPORT = "/var/esa-reports/demo.json"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the compose test is required under CI=true: {reason}")
    pytest.skip(reason)


def _engine_ready() -> bool:
    docker = shutil.which("docker")
    return (
        docker is not None and subprocess.run([docker, "info"], capture_output=True).returncode == 0
    )


def _prepare_engine() -> dict[str, str]:
    """deploy/engine.sh: the engine, the base images (their names returned), the wheelhouse."""
    if not _engine_ready() and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        _unavailable("no Docker engine answers and this user cannot install one (needs root)")
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "engine.sh"), "--base-images", "--wheelhouse"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    images: dict[str, str] = {}
    for line in done.stdout.splitlines():
        if line.startswith("export "):
            images.update(word.split("=", 1) for word in line.split()[1:])  # type: ignore[misc]
    assert set(images) == {"PYTHON_IMAGE", "POSTGRES_IMAGE"}, done.stdout
    return images


def _compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    found = shutil.which("docker-compose")
    assert found, "deploy/engine.sh installs a compose"
    return [found]


@dataclass
class Stack:
    """The compose project under test."""

    command: list[str]
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        done = subprocess.run(
            [*self.command, "-p", PROJECT, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
        return done.stdout

    def container(self, service: str) -> str:
        return self.run("ps", "-q", service).strip()

    def state(self, service: str) -> dict[str, object]:
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{json .State}}", self.container(service)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        state: dict[str, object] = json.loads(out)
        return state

    def health(self, service: str) -> str:
        health = self.state(service).get("Health") or {}
        return str(health.get("Status", "none"))  # type: ignore[union-attr]

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = {s: self.health(s) for s in SERVED}
            if all(h == "healthy" for h in states.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy in {timeout} s: {states}\n{self.logs()}")
            time.sleep(2)

    def sql(self, database: str, query: str) -> int:
        out = self.run("exec", "-T", "postgres", "psql", "-U", "esa", "-d", database, "-tAc", query)
        return int(out.strip())

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "40", check=False, timeout=60)


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    images = _prepare_engine()
    secret = {
        name: secrets.token_urlsafe(24)
        for name in (
            "POSTGRES_PASSWORD",
            "ESA_ADMIN_TOKEN",
            "ESA_SHUFFLER_1_TOKEN_SECRET",
            "ESA_SHUFFLER_2_TOKEN_SECRET",
            "ESA_SHUFFLER_3_TOKEN_SECRET",
        )
    }
    env = {**os.environ, **images, **secret, "ESA_ENROLL_PER_MINUTE": "120000"}
    env.pop("COMPOSE_PROJECT_NAME", None)
    deployment = Stack(_compose_command(), env)
    deployment.run("down", "-v", "--remove-orphans", timeout=120)  # an interrupted earlier run
    taken = [port for port in PORTS.values() if not _free(port)]
    assert not taken, f"ports {taken} are taken on 127.0.0.1: the compose file publishes them"
    try:
        # One build of each image: docker-compose 1.29 builds every service that has a
        # `build` (five times esa-pipeline); `up` then finds the images.
        deployment.run("build", "postgres", "init", timeout=900)
        deployment.run("up", "-d", timeout=300)
        deployment.wait_healthy()
        yield deployment
    finally:
        print(deployment.logs())
        deployment.run("down", "-v", "--remove-orphans", timeout=180, check=False)


def test_the_deployment_is_healthy_and_its_config_verifies_from_the_host(stack: Stack) -> None:
    for service, port in PORTS.items():
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
        assert stack.state(service)["Running"] is True
    key = stack.run("exec", "-T", "analyzer", "cat", "/var/esa/analyzer.pub").strip()
    signed = httpx.get("http://127.0.0.1:8100/v1/config", timeout=10).raise_for_status()
    document = SignedConfig.model_validate_json(signed.content)
    config = verify_config(document, load_ed25519_public(base64.b64decode(key)), time.time())
    urls = [shuffler.url for shuffler in config.shufflers]
    assert urls == [f"http://{s}:{p}" for s, p in PORTS.items() if s != "analyzer"]
    assert CHANNEL in {c.id for c in config.channels}
    other = load_ed25519_public(os.urandom(32))  # a key that did not sign it
    with pytest.raises(CollectionConfigError):
        verify_config(document, other, time.time())
    # The services run as the image's non-root user, with the production settings.
    assert stack.run("exec", "-T", "shuffler-1", "id", "-un").strip() == "esa"
    metrics = httpx.get("http://127.0.0.1:8101/metrics", timeout=5)
    assert metrics.status_code == 401  # exact counts are secret without the credential


def _loadgen(stack: Stack, log: Path) -> subprocess.Popen[bytes]:
    """The README's `run --rm --no-deps loadgen`, with a small population on one channel."""
    args = ["demo", "--analyzer-url", "http://analyzer:8100", "--var", "/var/esa"]
    args += ["--report", "/var/esa-reports/demo-report.html", "--json", REPORT]
    args += ["--devices", str(DEVICES), "--channel", CHANNEL]
    # Paced (~20 s of sending) so the test can kill a shuffler mid-run: unpaced, 500
    # contributions take well under a second and the kill raced the end of the run.
    args += ["--rate", str(RATE)]
    command = [*stack.command, "-p", PROJECT, "--profile", "loadgen", "run", "--rm", "--no-deps"]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*command, "-T", "loadgen", *args], cwd=ROOT, env=stack.env, stdout=out, stderr=out
        )


def _restarts(stack: Stack, service: str) -> int:
    out = subprocess.run(
        ["docker", "inspect", "--format", "{{.RestartCount}}", stack.container(service)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out)


def _conservation(stack: Stack) -> tuple[int, int]:
    """(acknowledged-side total at the shufflers: forwarded + deleted + held, and what the
    analyzer received), for the channel, after every part was delivered."""
    where = f"channel_id = '{CHANNEL}'"
    shuffled = received = 0
    for i in (1, 2, 3):
        db = f"esa_shuffler_{i}"
        assert stack.sql(db, "SELECT count(*) FROM batch_parts WHERE status <> 'forwarded'") == 0
        shuffled += stack.sql(
            db, f"SELECT coalesce(sum(n_contributions), 0) FROM batches WHERE {where}"
        )
        shuffled += stack.sql(db, f"SELECT coalesce(sum(deleted), 0) FROM groups WHERE {where}")
        shuffled += stack.sql(
            db, f"SELECT count(*) FROM contributions WHERE {where} AND held_part IS NOT NULL"
        )
    received = stack.sql(
        "esa_analyzer", f"SELECT coalesce(sum(n_contributions), 0) FROM receipts WHERE {where}"
    )
    return shuffled, received


def test_loadgen_certifies_epsilon_while_a_shuffler_crashes_and_restarts(
    stack: Stack, tmp_path: Path
) -> None:
    before = _restarts(stack, "shuffler-2")
    log = tmp_path / "loadgen.log"
    loadgen = _loadgen(stack, log)
    try:
        deadline = time.monotonic() + 240
        query = f"SELECT count(*) FROM contributions WHERE channel_id = '{CHANNEL}'"
        while stack.sql("esa_shuffler_2", query) < 20:  # acknowledged ones, mid-run
            assert loadgen.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        os.kill(int(stack.state("shuffler-2")["Pid"]), 9)  # type: ignore[call-overload]
        assert loadgen.wait(timeout=300) == 0, log.read_text()
    finally:
        if loadgen.poll() is None:
            loadgen.kill()
    output = log.read_text()
    assert _restarts(stack, "shuffler-2") > before  # restart: unless-stopped brought it back
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
    shuffled, received = _conservation(stack)
    assert received == result["n"] > 0  # the release counts what the analyzer received
    # Nothing acknowledged lost: every acknowledged contribution was forwarded, removed by
    # randomized deletion or held; one acknowledged by a shuffler that died before answering
    # is retried by its device and stored once (one per client, channel and epoch).
    assert result["delivered"] <= shuffled <= DEVICES, (result, shuffled)
    postgres_log = stack.run("logs", "--no-color", "postgres")
    assert "does not exist" not in postgres_log  # no query before the migrations


def test_down_and_up_keep_keys_and_data(stack: Stack) -> None:
    key = stack.run("exec", "-T", "analyzer", "cat", "/var/esa/analyzer.pub")
    received = stack.sql("esa_analyzer", "SELECT count(*) FROM receipts")
    stack.run("down", timeout=180)
    stack.run("up", "-d", timeout=300)
    stack.wait_healthy()
    assert stack.run("exec", "-T", "analyzer", "cat", "/var/esa/analyzer.pub") == key
    assert stack.sql("esa_analyzer", "SELECT count(*) FROM receipts") == received > 0
    init = stack.run("logs", "--no-color", "init")
    assert "nothing to do" in init  # init kept what it prepared
    privacy = httpx.get(f"http://127.0.0.1:8100/v1/channels/{CHANNEL}/privacy", timeout=10)
    assert privacy.status_code == 200 and privacy.json()["epochs"], privacy.text
