"""``esa up``: the embedded deployment — an analyzer and K shufflers as processes on 127.0.0.1.

On first run it creates ``<var>/keys/...`` (PEM, 0600) and writes the channel set and the
shuffler registry under ``<var>``; every service keeps its SQLite file under ``<var>``. It
refuses to start when a port is taken, waits until every service is ready, prints the URLs,
and on Ctrl-C / SIGTERM stops every process it started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from common.envelope import (
    load_or_create_ed25519,
    load_or_create_x25519,
    public_bytes,
    public_identity,
)
from common.wire import ChannelConfig, b64
from services.tools.catalogue import DEFAULT_CHANNELS

ANALYZER_PORT = 8100


class LaunchError(RuntimeError):
    """The deployment cannot start (port taken, a service did not become ready)."""


#: Settings every deployment of this layout runs with, whatever starts it (``esa up`` or
#: ``docker-compose.yml``). All simulated devices of ``esa demo`` share one address, so the
#: per-address enrolment limit is raised from its public-internet default.
SHARED_SETTINGS = {
    "ESA_SHUFFLER_ENROLL_PER_MINUTE": "120000",
    "ESA_SHUFFLER_BATCH_INTERVAL_SECONDS": "1.0",
    "ESA_SHUFFLER_FORWARD_INTERVAL_SECONDS": "0.5",
}


@dataclass(frozen=True)
class ServiceSpec:
    """How one service of the deployment runs: ``esa <command>`` with ``env`` on ``port``."""

    name: str
    command: tuple[str, ...]
    env: dict[str, str]
    port: int

    @property
    def url(self) -> str:
        """Its URL on 127.0.0.1."""
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Service:
    """One started process (``spec`` says how to start it again)."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path | None = None
    spec: ServiceSpec | None = None

    def log_tail(self, chars: int = 1500) -> str:
        """The end of its log (for error messages: the log may be deleted with its folder)."""
        try:
            return "" if self.log is None else self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, as in a crash."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def restart(self, timeout: float = 60.0) -> None:
        """Start the same command with the same environment again and wait until it is ready."""
        if self.spec is None or self.log is None:
            raise LaunchError(f"{self.name} was not started from a spec; it cannot be restarted")
        stop([self])
        self.process = start(self.spec, self.log).process
        wait_ready([self], timeout)


def port_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:port."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def database_url(template: str | None, var: Path, service: str) -> str:
    """The service's database: ``template`` with ``{service}`` (``analyzer``, ``shuffler_1``...)
    filled in, or a SQLite file under ``var/<service dir>/`` when no template is given."""
    if template is None:
        folder = "analyzer" if service == "analyzer" else service.replace("_", "-")
        name = "analyzer.db" if service == "analyzer" else "shuffler.db"
        return f"sqlite:///{var / folder / name}"
    if "{service}" not in template:
        raise LaunchError(f"database URL template {template!r} needs a {{service}} placeholder")
    return template.replace("{service}", service)


def analyzer_spec(var: Path, port: int, database: str) -> ServiceSpec:
    """The analyzer on ``port``, reading the channel file and shuffler registry under ``var``."""
    env = {
        "ESA_ANALYZER_PORT": str(port),
        "ESA_ANALYZER_DATABASE_URL": database,
        "ESA_ANALYZER_KEY_DIR": str(var / "keys" / "analyzer"),
        "ESA_ANALYZER_CHANNELS_FILE": str(var / "channels.json"),
        "ESA_ANALYZER_SHUFFLERS_FILE": str(var / "shufflers.json"),
    }
    return ServiceSpec("analyzer", ("analyzer", "serve"), env, port)


def shuffler_spec(
    var: Path, index: int, port: int, analyzer_url: str, database: str
) -> ServiceSpec:
    """Shuffler ``index`` (``shuffler-<index>``) on ``port``, forwarding to ``analyzer_url``."""
    sid = f"shuffler-{index}"
    env = {
        "ESA_SHUFFLER_SHUFFLER_ID": sid,
        "ESA_SHUFFLER_PORT": str(port),
        "ESA_SHUFFLER_DATABASE_URL": database,
        "ESA_SHUFFLER_KEY_DIR": str(var / "keys" / sid),
        "ESA_SHUFFLER_CHANNELS_FILE": str(var / "channels.json"),
        "ESA_SHUFFLER_ANALYZER_URL": analyzer_url,
        **SHARED_SETTINGS,
    }
    return ServiceSpec(sid, ("shuffler", "serve"), env, port)


def with_overrides(spec: ServiceSpec, overrides: Mapping[str, str]) -> ServiceSpec:
    """``spec`` with the overrides meant for its kind of service (``ESA_ANALYZER_*`` for the
    analyzer, ``ESA_SHUFFLER_*`` for every shuffler)."""
    prefix = "ESA_ANALYZER_" if spec.name == "analyzer" else "ESA_SHUFFLER_"
    mine = {k: v for k, v in overrides.items() if k.startswith(prefix)}
    return replace(spec, env={**spec.env, **mine})


def service_specs(
    var: Path,
    shufflers: int = 3,
    base_port: int = ANALYZER_PORT,
    *,
    database_template: str | None = None,
    analyzer_url: str | None = None,
    overrides: Mapping[str, str] | None = None,
) -> list[ServiceSpec]:
    """The analyzer and shufflers 1..K: command, environment and port of each (no side effects;
    ``docker-compose.yml`` is checked against this)."""
    analyzer_url = analyzer_url or f"http://127.0.0.1:{base_port}"
    specs = [analyzer_spec(var, base_port, database_url(database_template, var, "analyzer"))]
    for i in range(1, shufflers + 1):
        database = database_url(database_template, var, f"shuffler_{i}")
        specs.append(shuffler_spec(var, i, base_port + i, analyzer_url, database))
    return [with_overrides(spec, overrides or {}) for spec in specs]


def prepare(
    var: Path,
    shufflers: int = 3,
    base_port: int = ANALYZER_PORT,
    *,
    database_template: str | None = None,
    shuffler_url: str = "http://127.0.0.1:{port}",
    analyzer_url: str | None = None,
    channels: Sequence[ChannelConfig] = DEFAULT_CHANNELS,
    overrides: Mapping[str, str] | None = None,
) -> list[ServiceSpec]:
    """Keys, channel file, shuffler registry and the pinned analyzer key; returns the services.

    Writes ``var/keys/<service>/`` (PEM, 0600; existing keys are kept), ``var/channels.json``,
    ``var/shufflers.json`` (public keys and URLs, ``shuffler_url`` formatted with ``i`` and
    ``port``) and ``var/analyzer.pub`` (the analyzer's Ed25519 config-signing key, base64: what
    an app pins). ``overrides`` are settings for every service of a kind (tests use them to
    batch and forward faster).
    """
    registry = []
    for i in range(1, shufflers + 1):
        sid = f"shuffler-{i}"
        keys = var / "keys" / sid
        hpke = load_or_create_x25519(keys / "hpke.pem")
        signer = load_or_create_ed25519(keys / "signing.pem")
        url = shuffler_url.format(i=i, port=base_port + i)
        registry.append(
            {"id": sid, "url": url, **public_identity(hpke.public_key(), signer.public_key())}
        )
    var.mkdir(parents=True, exist_ok=True)
    (var / "channels.json").write_text(json.dumps([c.model_dump() for c in channels], indent=2))
    (var / "shufflers.json").write_text(json.dumps(registry, indent=2))
    signing = load_or_create_ed25519(var / "keys" / "analyzer" / "signing.pem")
    (var / "analyzer.pub").write_text(b64(public_bytes(signing.public_key())) + "\n")
    return service_specs(
        var,
        shufflers,
        base_port,
        database_template=database_template,
        analyzer_url=analyzer_url,
        overrides=overrides,
    )


def start(spec: ServiceSpec, log: Path) -> Service:
    """Spawn ``esa <spec.command>`` with its environment, logging to ``log`` (not yet ready)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *spec.command],
        env={**os.environ, **spec.env},
        stdout=handle,
        stderr=handle,
        start_new_session=True,
    )
    return Service(spec.name, spec.url, process, log, spec)


def start_all(specs: Sequence[ServiceSpec], logs: Path, timeout: float = 60.0) -> list[Service]:
    """Start every spec and return once all answer ``/readyz``.

    Raises:
        LaunchError: a service exited or did not become ready (nothing is left running).
    """
    services = [start(spec, logs / f"{spec.name}.log") for spec in specs]
    try:
        wait_ready(services, timeout)
    except BaseException:  # LaunchError, and Ctrl-C while waiting: leave nothing running
        stop(services)
        raise
    return services


def free_base_port(count: int, attempts: int = 50) -> int:
    """A port p such that p .. p + count - 1 are all free on 127.0.0.1 (for parallel tests)."""
    for _ in range(attempts):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if base + count < 65536 and all(port_free(base + i) for i in range(count)):
            return base
    raise LaunchError(f"no run of {count} free ports found on 127.0.0.1")


def wait_ready(services: list[Service], timeout: float) -> None:
    """Poll ``/readyz`` of every service until all answer 200.

    Raises:
        LaunchError: a service exited, or ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    pending = list(services)
    while pending:
        for service in list(pending):
            if service.process.poll() is not None:
                raise LaunchError(
                    f"{service.name} exited with {service.process.returncode}; the end of its "
                    f"log:\n{service.log_tail()}"
                )
            try:
                if httpx.get(service.url + "/readyz", timeout=1.0).status_code == 200:
                    pending.remove(service)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise LaunchError(
                f"not ready after {timeout:.0f} s: {', '.join(s.name for s in pending)}"
            )
        time.sleep(0.1)


def stop(services: list[Service]) -> None:
    """SIGTERM every service, then SIGKILL whatever is left after 10 s."""
    for service in services:
        if service.process.poll() is None:
            service.process.terminate()
    deadline = time.monotonic() + 10
    for service in services:
        try:
            service.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


def up(
    var: Path,
    shufflers: int = 3,
    base_port: int = ANALYZER_PORT,
    timeout: float = 60.0,
    database_template: str | None = None,
) -> list[Service]:
    """Start the deployment and return its services once all are ready.

    Raises:
        LaunchError: a port is taken or a service did not become ready (nothing is left running).
    """
    ports = [base_port + i for i in range(shufflers + 1)]
    taken = [p for p in ports if not port_free(p)]
    if taken:
        raise LaunchError(
            f"port(s) {', '.join(map(str, taken))} on 127.0.0.1 already in use: is "
            "another deployment running? Stop it or pass --base-port."
        )
    specs = prepare(var, shufflers, base_port, database_template=database_template)
    return start_all(specs, var / "logs", timeout)


def serve_forever(services: list[Service]) -> None:
    """Block until Ctrl-C / SIGTERM or a service dies, then stop everything."""
    stopping = {"flag": False}

    def _handler(signum: int, _: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    try:
        while not stopping["flag"]:
            dead = [s for s in services if s.process.poll() is not None]
            if dead:
                raise LaunchError(f"{dead[0].name} stopped unexpectedly")
            time.sleep(0.2)
    finally:
        stop(services)
