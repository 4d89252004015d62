"""The compose project the deploy tests share (tests/deploy/conftest.py starts it once per
session): how to reach the engine, run compose, make every party's secrets, read container
state, the keys the parties published and each trust domain's database."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.collection import TrustAnchors

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "esa-deploy-test"
PORTS = {"analyzer": 8100, "shuffler-1": 8101, "shuffler-2": 8102, "shuffler-3": 8103}
#: The trust domains, each with its own PostgreSQL server (``postgres-<party>``).
PARTIES = tuple(PORTS)
SHUFFLERS = PARTIES[1:]
DATABASES = tuple(f"postgres-{party}" for party in PARTIES)
SERVED = (*DATABASES, *PORTS)
#: Every profile: `down` removes a profile's containers only when the profile is named.
PROFILES = ("loadgen", "monitoring", "replicas")
#: The base images deploy/engine.sh --base-images exports (official, or the stand-ins).
IMAGES = {"PYTHON_IMAGE", "POSTGRES_IMAGE", "PROMETHEUS_IMAGE", "HAPROXY_IMAGE"}
#: What makes docker-compose.yml's secrets (``ESA_SECRETS_DIR`` tells compose where they are).
SECRETS_SCRIPT = ROOT / "deploy" / "party_secrets.py"
#: Where every party's published public material is, in the analyzer's and the loadgen's view.
PUBLISHED = "/var/esa/published"


def make_secrets(directory: Path) -> dict[str, str]:
    """Every party's secrets, made in ``directory`` by deploy/party_secrets.py as a user runs
    it; returns them by file name (``shuffler-1-admin-token``...)."""
    done = subprocess.run(
        [sys.executable, str(SECRETS_SCRIPT), "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    values = {path.name: path.read_text().strip() for path in directory.iterdir()}
    assert all(value not in done.stdout + done.stderr for value in values.values())
    return values


def database(party: str) -> str:
    """The database (and role) of ``party`` on its own server: ``esa_shuffler_1``..."""
    return "esa_" + party.replace("-", "_")


def rule_metrics() -> set[str]:
    """Every metric name deploy/prometheus/alerts.yml's expressions use."""
    rules = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    expressions = " ".join(re.findall(r"expr: (>-\n(?:\s{10}.*\n)+|.*)", rules))
    return set(re.findall(r"\b(?:esa_[a-z_]+|up)\b(?=[{\s)\[])", expressions))


def unavailable(reason: str) -> None:
    """Skip, or fail under ``CI=true`` (the compose tests are required there)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the compose test is required under CI=true: {reason}")
    pytest.skip(reason)


def _engine_ready() -> bool:
    docker = shutil.which("docker")
    return (
        docker is not None and subprocess.run([docker, "info"], capture_output=True).returncode == 0
    )


def prepare_engine() -> dict[str, str]:
    """deploy/engine.sh: the engine, the base images (their names returned), the wheelhouse."""
    if not _engine_ready() and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        unavailable("no Docker engine answers and this user cannot install one (needs root)")
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
    assert set(images) == IMAGES, done.stdout
    return images


def compose_command() -> list[str]:
    """``docker compose`` (v2) when present, else Debian's ``docker-compose`` 1.29."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    found = shutil.which("docker-compose")
    assert found, "deploy/engine.sh installs a compose"
    return [found]


def free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port``."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@dataclass
class Stack:
    """The compose project under test, and every party's secrets (by file name)."""

    command: list[str]
    env: dict[str, str]
    secrets: dict[str, str]

    def token(self, party: str, kind: str = "admin-token") -> str:
        """``party``'s own secret of ``kind`` (``admin-token``, ``metrics-token``...)."""
        return self.secrets[f"{party}-{kind}"]

    def containers(self) -> dict[str, str]:
        """Every container of the project, running or not: id -> its compose service."""
        out = subprocess.run(
            ["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
             "--format", '{{.ID}} {{.Label "com.docker.compose.service"}}'],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return dict(line.split() for line in out.splitlines() if line.strip())  # type: ignore[misc]

    def inspect(self, container: str) -> dict[str, Any]:
        """``docker inspect`` of one container."""
        out = subprocess.run(
            ["docker", "inspect", container], capture_output=True, text=True, check=True
        ).stdout
        (found,) = json.loads(out)
        return dict(found)

    def run(
        self,
        *args: str,
        timeout: float = 300,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> str:
        done = subprocess.run(
            [*self.command, "-p", PROJECT, *args],
            cwd=ROOT,
            env=self.env if env is None else env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
        return done.stdout

    def down(self, *, volumes: bool = False, timeout: float = 180, check: bool = True) -> None:
        """Take every profile's containers down (``--remove-orphans``; ``-v``: the volumes
        too), then remove what is left of the project (a container, one-off or not, that
        compose missed; a network docker has not removed yet) and wait until its networks are
        gone: a fixed-subnet network that outlives the down makes the next ``up`` fail with
        "networks have overlapping IPv4"."""
        flags = ["-v"] if volumes else []
        self.run(*self.profiles(), "down", *flags, "--remove-orphans", timeout=timeout, check=check)
        label = f"label=com.docker.compose.project={PROJECT}"
        left = list(self.containers())
        if left:
            subprocess.run(["docker", "rm", "-f", *left], capture_output=True, timeout=120)
        deadline = time.monotonic() + 60
        while True:
            networks = subprocess.run(
                ["docker", "network", "ls", "-q", "--filter", label],
                capture_output=True, text=True, timeout=60,
            ).stdout.split()  # fmt: skip
            if not networks:
                return
            subprocess.run(["docker", "network", "rm", *networks], capture_output=True, timeout=60)
            if time.monotonic() > deadline:
                assert not check, f"networks {networks} of {PROJECT} outlived its down by 60 s"
                return
            time.sleep(1)

    def container(self, service: str) -> str:
        """The id of ``service``'s container ("" when it has none), as ``compose ps -q``
        finds it but without a compose process per call (~1 s with docker-compose 1.29)."""
        labels = (f"project={PROJECT}", f"service={service}", "oneoff=False")
        filters = [w for label in labels for w in ("--filter", f"label=com.docker.compose.{label}")]
        out = subprocess.run(
            ["docker", "ps", "-a", "-q", *filters], capture_output=True, text=True, check=True
        ).stdout.split()
        return out[0] if out else ""

    def exec(self, service: str, *args: str, timeout: float = 120) -> str:
        """``compose exec -T service args...`` through ``docker exec`` (no compose process:
        the conservation check asks a dozen queries); its output, asserting it succeeded."""
        done = subprocess.run(
            ["docker", "exec", self.container(service), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, (service, args, done.stdout[-3000:], done.stderr[-3000:])
        return done.stdout

    @staticmethod
    def profiles() -> list[str]:
        """``--profile`` for every profile (compose sees profile services only so)."""
        return [word for p in PROFILES for word in ("--profile", p)]

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
        health = self.state(service).get("Health")
        return str(health.get("Status", "none")) if isinstance(health, dict) else "none"

    def restarts(self, service: str) -> int:
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{.RestartCount}}", self.container(service)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(out)

    def wait_healthy(self, timeout: float = 240, services: tuple[str, ...] = SERVED) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = {s: self.health(s) for s in services}
            if all(h == "healthy" for h in states.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy in {timeout} s: {states}\n{self.logs()}")
            time.sleep(2)

    def wait_config(self, timeout: float = 120) -> dict[str, object]:
        """Wait until the analyzer serves its signed config on the host's port: 503
        ``shufflers_unavailable`` until it has fetched every shuffler's signed descriptor,
        which its healthcheck (``/readyz``) does not wait for. Returns the document."""
        deadline, last = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline:
            try:
                answer = httpx.get("http://127.0.0.1:8100/v1/config", timeout=5)
                if answer.status_code == 200:
                    document: dict[str, object] = answer.json()
                    return document
                last = f"{answer.status_code} {answer.text[:300]}"
            except httpx.HTTPError as error:
                last = f"{type(error).__name__}: {error}"
            time.sleep(1)
        raise AssertionError(f"no config served in {timeout} s: {last}\n{self.logs('analyzer')}")

    def trust(self) -> TrustAnchors:
        """The keys a device pins, as the parties published them: the analyzer's
        ``analyzer.pub`` and each shuffler's own signed descriptor, read in the analyzer's
        container, which mounts every published volume (read-only but its own)."""
        code = (
            "import json, pathlib; from common.collection import TrustAnchors; "
            f"print(json.dumps(TrustAnchors.read(pathlib.Path('{PUBLISHED}')).to_json()))"
        )
        text = self.exec("analyzer", "python", "-c", code)
        return TrustAnchors.from_json(json.loads(text))

    def sql(self, party: str, query: str) -> int:
        """One number from ``party``'s own database, asked on its server (its local socket)."""
        name = database(party)
        args = ["psql", "-U", name, "-d", name, "-tAc", query]
        return int(self.exec(f"postgres-{party}", *args).strip())

    def logs(self, *services: str) -> str:
        args = ["logs", "--no-color", "--tail", "40", *services]
        return self.run(*self.profiles(), *args, check=False, timeout=60)

    def conservation(self, channel: str) -> tuple[int, int]:
        """(acknowledged-side total at the shufflers: forwarded + deleted + held, and what the
        analyzer received), for ``channel``, after every part was delivered."""
        where = f"channel_id = '{channel}'"
        shuffled = 0
        for db in SHUFFLERS:
            assert self.sql(db, "SELECT count(*) FROM batch_parts WHERE status <> 'forwarded'") == 0
            shuffled += self.sql(
                db, f"SELECT coalesce(sum(n_contributions), 0) FROM batches WHERE {where}"
            )
            shuffled += self.sql(db, f"SELECT coalesce(sum(deleted), 0) FROM groups WHERE {where}")
            shuffled += self.sql(
                db, f"SELECT count(*) FROM contributions WHERE {where} AND held_part IS NOT NULL"
            )
        received = self.sql(
            "analyzer", f"SELECT coalesce(sum(n_contributions), 0) FROM receipts WHERE {where}"
        )
        return shuffled, received
