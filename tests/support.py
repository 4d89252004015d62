"""Helpers for tests that run real service processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

#: A shuffler channel policy small enough for tests to fill and close groups quickly.
SMALL_CHANNEL = {
    "id": "homepage",
    "epoch_seconds": 3600,
    "min_crowd": 5,
    "eps_cr": 1.0,
    "delta_cr": 1e-3,
    "max_fragments": 4,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServiceProcess:
    """A service started as ``python -m services.cli ...`` with its own environment."""

    args: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServiceProcess:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *self.args],
            env={**os.environ, **self.env},
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"service exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"service not ready: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, like a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def shuffler_process(
    tmp: Path,
    shuffler_id: str,
    channels: list[dict[str, Any]],
    database_url: str | None = None,
    **env: str,
) -> ServiceProcess:
    port = free_port()
    base = {
        "ESA_SHUFFLER_SHUFFLER_ID": shuffler_id,
        "ESA_SHUFFLER_PORT": str(port),
        "ESA_SHUFFLER_DATABASE_URL": database_url or f"sqlite:///{tmp / shuffler_id / 'db.sqlite'}",
        "ESA_SHUFFLER_KEY_DIR": str(tmp / shuffler_id / "keys"),
        "ESA_SHUFFLER_CHANNELS": json.dumps(channels),
        "ESA_SHUFFLER_BATCH_INTERVAL_SECONDS": "0.2",
        "ESA_SHUFFLER_FORWARD_INTERVAL_SECONDS": "0.2",
        "ESA_SHUFFLER_BACKOFF_BASE_SECONDS": "0.2",
        "ESA_SHUFFLER_BACKOFF_CAP_SECONDS": "1.0",
    }
    base.update({f"ESA_SHUFFLER_{k.upper()}": v for k, v in env.items()})
    return ServiceProcess(["shuffler", "serve"], base, port, tmp / f"{shuffler_id}.log")


def analyzer_process(
    tmp: Path,
    channels: list[dict[str, Any]],
    shufflers: list[dict[str, Any]],
    database_url: str | None = None,
    **env: str,
) -> ServiceProcess:
    port = free_port()
    base = {
        "ESA_ANALYZER_PORT": str(port),
        "ESA_ANALYZER_DATABASE_URL": database_url or f"sqlite:///{tmp / 'analyzer' / 'db.sqlite'}",
        "ESA_ANALYZER_KEY_DIR": str(tmp / "analyzer" / "keys"),
        "ESA_ANALYZER_CHANNELS": json.dumps(channels),
        "ESA_ANALYZER_SHUFFLERS": json.dumps(shufflers),
    }
    base.update({f"ESA_ANALYZER_{k.upper()}": v for k, v in env.items()})
    return ServiceProcess(["analyzer", "serve"], base, port, tmp / "analyzer.log")


@dataclass
class Deployment:
    """An analyzer and shuffler processes wired together (shuffler keys made by the test)."""

    analyzer: ServiceProcess
    shufflers: list[ServiceProcess]
    signing_keys: dict[str, Any]

    def trusted_key(self) -> str:
        """The analyzer's config-signing key, as an app would pin it."""
        document = httpx.get(self.analyzer.url + "/v1/config").json()
        return str(document["config"]["analyzer"]["signing_key"])

    def stop(self) -> None:
        for process in [*self.shufflers, self.analyzer]:
            process.stop()


def start_deployment(
    tmp: Path, channels: list[Any], analyzer_db: str | None = None, count: int = 3
) -> Deployment:
    """Shufflers 1..count and an analyzer on 127.0.0.1, each shuffler forwarding to it."""
    from common.envelope import load_or_create_ed25519, load_or_create_x25519, public_identity

    registry, signing, shufflers = [], {}, []
    for i in range(1, count + 1):
        sid = f"shuffler-{i}"
        keys = tmp / sid / "keys"
        hpke = load_or_create_x25519(keys / "hpke.pem")
        signing[sid] = load_or_create_ed25519(keys / "signing.pem")
        process = shuffler_process(tmp, sid, [c.policy().model_dump() for c in channels])
        shufflers.append(process)
        identity = public_identity(hpke.public_key(), signing[sid].public_key())
        registry.append({"id": sid, "url": process.url, **identity})
    analyzer = analyzer_process(
        tmp, [c.model_dump() for c in channels], registry, analyzer_db
    ).start()
    for process in shufflers:
        process.env["ESA_SHUFFLER_ANALYZER_URL"] = analyzer.url
        process.start()
    return Deployment(analyzer, shufflers, signing)


def close_epoch(deployment: Deployment, channel_id: str, epoch: int) -> None:
    """Close an epoch at every shuffler now (batches are forwarded right away)."""
    for process in deployment.shufflers:
        response = httpx.post(
            process.url + "/v1/admin/close",
            timeout=60,
            headers={"Authorization": "Bearer development"},
            json={"channel_id": channel_id, "epoch": epoch},
        )
        assert response.status_code == 200, response.text


@dataclass
class Receiver:
    """A minimal analyzer stand-in for forwarding tests: records every POSTed batch."""

    port: int
    status: int = 201
    bodies: list[tuple[bytes, str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def batch_ids(self) -> set[str]:
        return {json.loads(body)["batch_id"] for body, _ in self.bodies}


@contextmanager
def receiver(port: int | None = None) -> Iterator[Receiver]:
    state = Receiver(port or free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            state.bodies.append((body, self.headers.get("ESA-Signature", "")))
            self.send_response(state.status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    state.server = ThreadingHTTPServer(("127.0.0.1", state.port), Handler)
    thread = threading.Thread(target=state.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.server.shutdown()
        state.server.server_close()


def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError("condition not met in time")
