"""The compose project the deploy tests share (tests/deploy/conftest.py starts it once per
session): how to reach the engine, run compose, read container state and the databases."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from common.collection import TrustAnchors

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "esa-deploy-test"
PORTS = {"analyzer": 8100, "shuffler-1": 8101, "shuffler-2": 8102, "shuffler-3": 8103}
SERVED = ("postgres", *PORTS)
#: Every profile: `down` removes a profile's containers only when the profile is named.
PROFILES = ("loadgen", "monitoring", "replicas")
#: The base images deploy/engine.sh --base-images exports (official, or the stand-ins).
IMAGES = {"PYTHON_IMAGE", "POSTGRES_IMAGE", "PROMETHEUS_IMAGE", "HAPROXY_IMAGE"}
#: The secrets docker-compose.yml interpolates (compose refuses to run without each).
SECRET_NAMES = (
    "POSTGRES_PASSWORD",
    "ESA_ADMIN_TOKEN",
    "ESA_SHUFFLER_1_TOKEN_SECRET",
    "ESA_SHUFFLER_2_TOKEN_SECRET",
    "ESA_SHUFFLER_3_TOKEN_SECRET",
)


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
    """The compose project under test."""

    command: list[str]
    env: dict[str, str]

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

    def container(self, service: str) -> str:
        return self.run(*self.profiles(), "ps", "-q", service).strip()

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
        """The keys a device pins, as ``init`` wrote them (``/var/esa/trust.json``)."""
        text = self.run("exec", "-T", "analyzer", "cat", "/var/esa/trust.json")
        return TrustAnchors.from_json(json.loads(text))

    def sql(self, database: str, query: str) -> int:
        out = self.run("exec", "-T", "postgres", "psql", "-U", "esa", "-d", database, "-tAc", query)
        return int(out.strip())

    def logs(self, *services: str) -> str:
        args = ["logs", "--no-color", "--tail", "40", *services]
        return self.run(*self.profiles(), *args, check=False, timeout=60)

    def conservation(self, channel: str) -> tuple[int, int]:
        """(acknowledged-side total at the shufflers: forwarded + deleted + held, and what the
        analyzer received), for ``channel``, after every part was delivered."""
        where = f"channel_id = '{channel}'"
        shuffled = 0
        for i in (1, 2, 3):
            db = f"esa_shuffler_{i}"
            assert self.sql(db, "SELECT count(*) FROM batch_parts WHERE status <> 'forwarded'") == 0
            shuffled += self.sql(
                db, f"SELECT coalesce(sum(n_contributions), 0) FROM batches WHERE {where}"
            )
            shuffled += self.sql(db, f"SELECT coalesce(sum(deleted), 0) FROM groups WHERE {where}")
            shuffled += self.sql(
                db, f"SELECT count(*) FROM contributions WHERE {where} AND held_part IS NOT NULL"
            )
        received = self.sql(
            "esa_analyzer", f"SELECT coalesce(sum(n_contributions), 0) FROM receipts WHERE {where}"
        )
        return shuffled, received
