"""``esa up``: the embedded deployment — an analyzer and K shufflers as processes on 127.0.0.1.

On first run it creates ``<var>/keys/<party>/...`` (PEM, 0600), and each party's own secrets
there (:data:`PARTY_SECRETS`: admin tokens, the shufflers' metrics tokens and client-token
secrets), handed to each service as files (``..._FILE``), never shared: every party is its own
trust domain. It writes the channel set, the shuffler registry and the keys an app pins under
``<var>``; every service keeps its SQLite file under ``<var>``. It
refuses to start when a port is taken, waits until every service is ready, prints the URLs,
and on Ctrl-C / SIGTERM stops every process it started; meanwhile it restarts a process behind
HAProxy that dies (:func:`serve_forever`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from common.collection import ANALYZER_PARTY, TrustAnchors, shuffler_party
from common.envelope import load_ed25519_public, public_bytes
from common.files import create_once
from common.wire import ChannelConfig, b64, unb64
from runtime import haproxy
from runtime.keys import SIGNING, STATE_FILE, KeyDirectory
from services.tools import stopping
from services.tools.catalogue import DEFAULT_CHANNELS

ANALYZER_PORT = 8100


class LaunchError(RuntimeError):
    """The deployment cannot start (port taken, a service did not become ready)."""


#: Settings every deployment of this layout runs with, whatever starts it (``esa up`` or
#: ``docker-compose.yml``).
SHARED_SETTINGS = {
    "ESA_SHUFFLER_BATCH_INTERVAL_SECONDS": "1.0",
    "ESA_SHUFFLER_FORWARD_INTERVAL_SECONDS": "0.5",
}
#: Origins of a web page served on this machine's port 8000 (``python -m http.server``'s
#: default; the example page's, docs/operations.md, "Browsers (CORS)"): in the local profile,
#: devices on it may call every party's device routes.
EXAMPLE_PAGE_ORIGINS = "http://127.0.0.1:8000,http://localhost:8000"
#: Settings of the local profile only (``esa up``, ``esa demo``, the tests): every simulated
#: device enrols from 127.0.0.1, so the per-address enrolment limit is raised, and devices on
#: a page of :data:`EXAMPLE_PAGE_ORIGINS` may call the device routes. The production profile
#: (``docker-compose.yml``) keeps the shuffler's default limit (enrolment is open: the limit
#: is what slows a flood of fake devices, README "Honest crowds") and allows no page.
LOCAL_SETTINGS = {
    "ESA_SHUFFLER_ENROLL_PER_MINUTE": "120000",
    "ESA_SHUFFLER_CORS_ORIGINS": EXAMPLE_PAGE_ORIGINS,
    "ESA_ANALYZER_CORS_ORIGINS": EXAMPLE_PAGE_ORIGINS,
}
#: ``local``: :data:`LOCAL_SETTINGS` on top of :data:`SHARED_SETTINGS`; ``production``: only
#: the shared ones.
Profile = Literal["local", "production"]
#: A shuffler's client-token secret (HMAC key), next to its private keys.
TOKEN_SECRET_FILE = "token-secret"
#: A party's admin bearer token, and a shuffler's metrics bearer token (its exact counts are
#: secrets until released), next to its private keys.
ADMIN_TOKEN_FILE = "admin-token"
METRICS_TOKEN_FILE = "metrics-token"
#: Each kind of party's secrets: the file in its key folder and the setting it is given as.
PARTY_SECRETS = {
    "analyzer": {ADMIN_TOKEN_FILE: "ESA_ANALYZER_ADMIN_TOKEN"},
    "shuffler": {
        TOKEN_SECRET_FILE: "ESA_SHUFFLER_TOKEN_SECRET",
        ADMIN_TOKEN_FILE: "ESA_SHUFFLER_ADMIN_TOKEN",
        METRICS_TOKEN_FILE: "ESA_SHUFFLER_METRICS_TOKEN",
    },
}
#: The keys an app pins, one per trust domain (:class:`common.collection.TrustAnchors`).
TRUST_FILE = "trust.json"
#: One development token as every party's admin and metrics token, as overrides of
#: :func:`prepare`: for test and benchmark harnesses that address every party alike, never for
#: a deployment (``esa up`` gives each party its own).
DEVELOPMENT_TOKENS = {
    "ESA_ANALYZER_ADMIN_TOKEN": "development",
    "ESA_SHUFFLER_ADMIN_TOKEN": "development",
    "ESA_SHUFFLER_METRICS_TOKEN": "development",
}
#: Where devices reach shuffler i, unless told otherwise (``{i}``, ``{port}`` filled in).
SHUFFLER_URL = "http://127.0.0.1:{port}"


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


def local_settings(prefix: str, profile: Profile) -> dict[str, str]:
    """The :data:`LOCAL_SETTINGS` of one kind of party (``ESA_ANALYZER_`` or
    ``ESA_SHUFFLER_``) in the local profile; none in production."""
    if profile != "local":
        return {}
    return {k: v for k, v in LOCAL_SETTINGS.items() if k.startswith(prefix)}


def analyzer_spec(var: Path, port: int, database: str, profile: Profile = "local") -> ServiceSpec:
    """The analyzer on ``port``, reading the channel file and shuffler registry under ``var``,
    with the settings of ``profile``."""
    env = {
        "ESA_ANALYZER_PORT": str(port),
        "ESA_ANALYZER_DATABASE_URL": database,
        "ESA_ANALYZER_KEY_DIR": str(var / "keys" / "analyzer"),
        "ESA_ANALYZER_TRAINING_DIR": str(var / "training"),
        "ESA_ANALYZER_CHANNELS_FILE": str(var / "channels.json"),
        "ESA_ANALYZER_SHUFFLERS_FILE": str(var / "shufflers.json"),
        **local_settings("ESA_ANALYZER_", profile),
    }
    return ServiceSpec("analyzer", ("analyzer", "serve"), env, port)


def shuffler_spec(
    var: Path,
    index: int,
    port: int,
    analyzer_url: str,
    database: str,
    profile: Profile = "local",
    shuffler_url: str = SHUFFLER_URL,
) -> ServiceSpec:
    """Shuffler ``index`` (``shuffler-<index>``) on ``port``, forwarding to ``analyzer_url``,
    with the settings of ``profile``; its descriptor vouches for ``shuffler_url`` (``{i}`` and
    ``{port}`` filled in) as where devices reach it."""
    sid = f"shuffler-{index}"
    env = {
        "ESA_SHUFFLER_SHUFFLER_ID": sid,
        "ESA_SHUFFLER_PORT": str(port),
        "ESA_SHUFFLER_PUBLIC_URL": shuffler_url.format(i=index, port=port),
        "ESA_SHUFFLER_DATABASE_URL": database,
        "ESA_SHUFFLER_KEY_DIR": str(var / "keys" / sid),
        "ESA_SHUFFLER_CHANNELS_FILE": str(var / "channels.json"),
        "ESA_SHUFFLER_ANALYZER_URL": analyzer_url,
        # the analyzer's published config-signing key: channel changes in its signed config
        **({"ESA_SHUFFLER_ANALYZER_KEY_FILE": str(var / "analyzer.pub")} if analyzer_url else {}),
        **SHARED_SETTINGS,
        **local_settings("ESA_SHUFFLER_", profile),
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
    profile: Profile = "local",
    shuffler_url: str = SHUFFLER_URL,
) -> list[ServiceSpec]:
    """The analyzer and shufflers 1..K: command, environment and port of each (no side effects,
    no secrets; ``docker-compose.yml`` is checked against the ``production`` profile)."""
    analyzer_url = analyzer_url or f"http://127.0.0.1:{base_port}"
    database = database_url(database_template, var, "analyzer")
    specs = [analyzer_spec(var, base_port, database, profile)]
    for i in range(1, shufflers + 1):
        database = database_url(database_template, var, f"shuffler_{i}")
        specs.append(
            shuffler_spec(var, i, base_port + i, analyzer_url, database, profile, shuffler_url)
        )
    return [with_overrides(spec, overrides or {}) for spec in specs]


def load_or_create_secret(path: Path) -> str:
    """The secret in ``path``, created on first use: 256 bits from the OS CSPRNG, URL-safe
    base64, in a file only its owner can read (0600, never overwritten).

    Raises:
        LaunchError: the file exists but holds no usable secret (>= 16 characters).
    """
    if not path.exists():  # when another process creates it first, that one is used
        create_once(path, (secrets.token_urlsafe(32) + "\n").encode())
    secret = path.read_text().strip()
    if len(secret) < 16:
        raise LaunchError(f"{path} holds no secret of >= 16 characters; delete it to renew it")
    return secret


def new_secrets(var: Path, names: Sequence[str]) -> dict[str, dict[str, str]]:
    """Every party's secrets (:data:`PARTY_SECRETS`) under ``var/keys``, created where missing
    (:func:`load_or_create_secret`); returns the ones this call created, by party and file
    (``esa up`` shows those once)."""
    created: dict[str, dict[str, str]] = {}
    for name in names:
        for file in PARTY_SECRETS["analyzer" if name == "analyzer" else "shuffler"]:
            path = var / "keys" / name / file
            if not path.exists():
                created.setdefault(name, {})[file] = load_or_create_secret(path)
    return created


def with_party_secrets(specs: Sequence[ServiceSpec], var: Path) -> list[ServiceSpec]:
    """Each party with its own secrets (``var/keys/<party>/...``, created on first use), given
    as files (``ESA_..._FILE``): a token one shuffler issued is refused by every other, and no
    party's admin or metrics token opens another's. A secret already in a spec's environment
    (an override, e.g. a test's) is kept instead."""
    out = []
    for spec in specs:
        party = "analyzer" if spec.name == "analyzer" else "shuffler"
        env = dict(spec.env)
        for file, variable in PARTY_SECRETS[party].items():
            path = var / "keys" / spec.name / file
            load_or_create_secret(path)
            if variable not in env:
                env.setdefault(f"{variable}_FILE", str(path))
        out.append(replace(spec, env=env))
    return out


def prepare(
    var: Path,
    shufflers: int = 3,
    base_port: int = ANALYZER_PORT,
    *,
    database_template: str | None = None,
    shuffler_url: str = SHUFFLER_URL,
    analyzer_url: str | None = None,
    channels: Sequence[ChannelConfig] = DEFAULT_CHANNELS,
    overrides: Mapping[str, str] | None = None,
) -> list[ServiceSpec]:
    """Keys, channel file, shuffler registry and the keys an app pins; returns the services.

    Writes ``var/keys/<service>/`` (PEM, 0600; existing keys are kept; each party's own
    secrets, 0600, passed to it as files: :func:`with_party_secrets`),
    ``var/channels.json``, ``var/shufflers.json`` (the analyzer's registry: each shuffler's id,
    the URL its signed descriptor is fetched from — ``shuffler_url`` with ``i`` and ``port`` —
    and its Ed25519 signing key), ``var/trust.json`` (what an app pins: the analyzer's
    config-signing key and every shuffler's signing key) and ``var/analyzer.pub`` (the
    analyzer's key alone); after rotations, the keys that sign now (:func:`current_signer`),
    never a retired one. ``overrides`` are settings for every service of a kind (tests use
    them to batch and forward faster).
    """
    registry, pinned = [], {}
    for i in range(1, shufflers + 1):
        sid = f"shuffler-{i}"
        signer = current_signer(var / "keys" / sid, shuffler_party(sid))
        url = shuffler_url.format(i=i, port=base_port + i)
        registry.append({"id": sid, "url": url, "signing_key": b64(public_bytes(signer))})
        pinned[sid] = signer
    var.mkdir(parents=True, exist_ok=True)
    (var / "channels.json").write_text(json.dumps([c.model_dump() for c in channels], indent=2))
    (var / "shufflers.json").write_text(json.dumps(registry, indent=2))
    signing = current_signer(var / "keys" / "analyzer", ANALYZER_PARTY)
    (var / "analyzer.pub").write_text(b64(public_bytes(signing)) + "\n")
    trust = TrustAnchors(signing, pinned)
    (var / TRUST_FILE).write_text(json.dumps(trust.to_json(), indent=2) + "\n")
    specs = service_specs(
        var,
        shufflers,
        base_port,
        database_template=database_template,
        analyzer_url=analyzer_url,
        overrides=overrides,
        shuffler_url=shuffler_url,
    )
    return with_party_secrets(specs, var)


def current_signer(directory: Path, party: str) -> Ed25519PublicKey:
    """The key that signs for ``party`` now, what an app and the analyzer pin: the newest
    active signing key of ``keys.json`` once keys have rotated (no key file is made again:
    a retired one was deleted on purpose), else ``signing.pem`` (``hpke.pem`` and it made on
    first use)."""
    record = KeyDirectory(directory, party).book().newest_active(SIGNING, time.time())
    if record is None:
        raise LaunchError(f"{directory / STATE_FILE}: no active signing key")
    return load_ed25519_public(unb64(record.public_key))


def start(spec: ServiceSpec, log: Path) -> Service:
    """Spawn ``esa <spec.command>`` with its environment, logging to ``log`` (not yet ready)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as handle:  # the child keeps its own copy (a restart leaks no file)
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *spec.command],
            env={**os.environ, **spec.env},
            stdout=handle,
            stderr=handle,
            start_new_session=True,
        )
    _started(process)
    return Service(name=spec.name, url=spec.url, process=process, log=log, spec=spec)


#: Every process this process started (:func:`start`, HAProxy) and has not stopped yet, for
#: :func:`stop_started`.
_STARTED: set[subprocess.Popen[bytes]] = set()
_STARTED_LOCK = threading.Lock()


def _started(process: subprocess.Popen[bytes]) -> None:
    with _STARTED_LOCK:
        _STARTED.add(process)


def start_all(specs: Sequence[ServiceSpec], logs: Path, timeout: float = 60.0) -> list[Service]:
    """Start every spec and return once all answer ``/readyz``.

    Raises:
        LaunchError: a service exited or did not become ready (nothing is left running).
    """
    services: list[Service] = []
    try:
        for spec in specs:
            with stopping.held():  # a stop arriving meanwhile waits until it is recorded
                services.append(start(spec, logs / f"{spec.name}.log"))
        wait_ready(services, timeout)
    except BaseException:  # LaunchError, and Ctrl-C while waiting: leave nothing running
        stop(services)
        raise
    return services


def wait_config(analyzer: Service, timeout: float) -> None:
    """Poll the analyzer's ``GET /v1/config`` until it answers 200: until then it has not
    fetched and verified every shuffler's signed descriptor (``503 shufflers_unavailable``),
    and a device could not take the config.

    Raises:
        LaunchError: ``timeout`` seconds passed (the last answer is named).
    """
    deadline, last = time.monotonic() + timeout, "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                response = client.get(analyzer.url + "/v1/config")
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:300]}"
            except httpx.HTTPError as error:
                last = f"{type(error).__name__}: {error}"
            time.sleep(0.1)
    raise LaunchError(f"the analyzer serves no collection config after {timeout:.0f} s: {last}")


#: Where test and throw-away deployments look for free ports: below the kernel's ephemeral
#: range, so that a service restarted on its port never finds it taken by some process's
#: outgoing connection (which the kernel numbers from the ephemeral range).
PORT_FLOOR = 10_000


def ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux
    ``ip_local_port_range``; 32768, its default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_base_port(count: int, attempts: int = 200) -> int:
    """A port p such that p .. p + count - 1 are all free on 127.0.0.1 (for parallel tests),
    chosen at random below the ephemeral range (:data:`PORT_FLOOR`)."""
    top = ephemeral_floor() - count
    for _ in range(attempts):
        if top - PORT_FLOOR >= 1_000:
            base = PORT_FLOOR + secrets.randbelow(top - PORT_FLOOR)
        else:  # a kernel whose ephemeral range starts low: any port the kernel offers
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
    # One client for every poll: a new one per request builds a TLS context (~20 ms of CPU).
    with httpx.Client(timeout=1.0) as client:
        while pending:
            for service in list(pending):
                if service.process.poll() is not None:
                    raise LaunchError(
                        f"{service.name} exited with {service.process.returncode}; the end of "
                        f"its log:\n{service.log_tail()}"
                    )
                try:
                    if client.get(service.url + "/readyz").status_code == 200:
                        pending.remove(service)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise LaunchError(
                    f"not ready after {timeout:.0f} s: {', '.join(s.name for s in pending)}"
                )
            time.sleep(0.1)


#: Seconds a service has after SIGTERM to finish its requests and stop before it is killed.
STOP_GRACE_SECONDS = 10.0


def stop(services: Sequence[Service], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM every service, SIGKILL whatever is left after ``grace`` seconds, then SIGKILL
    every process still in a service's process group: each starts in a session of its own
    (:func:`start`), so its own workers (the analyzer's opening processes) are there, and
    none outlives a service that was killed or died."""
    _stop_processes([service.process for service in services], grace)


def stop_started(grace: float = STOP_GRACE_SECONDS) -> None:
    """:func:`stop` every process this process started and has not stopped: what a command
    calls on its way out, so that none is left behind whichever step was interrupted (even
    one whose services were started but not yet handed back)."""
    with _STARTED_LOCK:
        processes = list(_STARTED)
    _stop_processes(processes, grace)


def _stop_processes(processes: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """:func:`stop` for processes (HAProxy serves several frontends from one)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for group in {process.pid for process in processes}:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # an empty group
            os.killpg(group, signal.SIGKILL)
    with _STARTED_LOCK:
        _STARTED.difference_update(processes)


def check_scale(database_template: str | None, replicas: int, workers: int) -> None:
    """Refuse replicas or analyzer workers on SQLite (the single-process embedded default).

    Raises:
        LaunchError: ``replicas`` or ``workers`` > 1 without a PostgreSQL URL template.
    """
    if replicas < 1 or workers < 1:
        raise LaunchError(f"need replicas and analyzer workers >= 1, got {replicas}, {workers}")
    scaled = replicas > 1 or workers > 1
    if scaled and not (database_template or "").startswith("postgresql"):
        raise LaunchError(
            f"--replicas {replicas} / --analyzer-workers {workers} need PostgreSQL: SQLite is "
            "the single-process embedded default. Pass --database-url-template "
            "'postgresql+psycopg://USER@HOST:5432/esa_{service}' (the replicas of a service "
            "share its database)."
        )


def scale(
    specs: Sequence[ServiceSpec], replicas: int, workers: int, base_port: int
) -> tuple[list[ServiceSpec], list[haproxy.Frontend]]:
    """The processes behind HAProxy: ``workers`` copies of the analyzer (``analyzer.w1``...)
    and ``replicas`` of each shuffler (``shuffler-1.r1``...), on the ports after the public
    ones (which HAProxy takes: base, base + 1..K, so URLs, registry and keys are unchanged)."""
    processes: list[ServiceSpec] = []
    frontends: list[haproxy.Frontend] = []
    port = base_port + len(specs)
    for spec in specs:
        shuffler = spec.command[0] == "shuffler"
        copies, suffix = (replicas, "r") if shuffler else (workers, "w")
        party = "ESA_SHUFFLER" if shuffler else "ESA_ANALYZER"
        ports = tuple(range(port, port + copies))
        port += copies
        # HAProxy connects from 127.0.0.1: only there is X-Forwarded-For the device's address.
        proxies = {f"{party}_TRUSTED_PROXIES": haproxy.ADDRESS}
        for n, p in enumerate(ports, start=1):
            env = {**proxies, **spec.env, f"{party}_PORT": str(p)}
            processes.append(replace(spec, name=f"{spec.name}.{suffix}{n}", env=env, port=p))
        frontends.append(haproxy.Frontend(spec.name, spec.port, ports, shuffler))
    return processes, frontends


def scaled_ports(shufflers: int, replicas: int, workers: int) -> int:
    """Ports a deployment takes from its base port (public ones, then its processes')."""
    public = shufflers + 1
    return public if replicas == workers == 1 else public + workers + shufflers * replicas


def up(
    var: Path,
    shufflers: int = 3,
    base_port: int = ANALYZER_PORT,
    timeout: float = 60.0,
    database_template: str | None = None,
    *,
    replicas: int = 1,
    workers: int = 1,
    channels: Sequence[ChannelConfig] = DEFAULT_CHANNELS,
    overrides: Mapping[str, str] | None = None,
) -> list[Service]:
    """Start the deployment and return its services once all are ready: with ``replicas`` or
    ``workers`` > 1 (PostgreSQL only), the processes behind HAProxy (:func:`start_scaled`).

    Raises:
        LaunchError: a port is taken, SQLite was asked for replicas, or a service did not
            become ready (nothing is left running).
    """
    check_scale(database_template, replicas, workers)
    ports = [base_port + i for i in range(scaled_ports(shufflers, replicas, workers))]
    taken = [p for p in ports if not port_free(p)]
    if taken:
        raise LaunchError(
            f"port(s) {', '.join(map(str, taken))} on 127.0.0.1 already in use: is "
            "another deployment running? Stop it or pass --base-port."
        )
    specs = prepare(
        var,
        shufflers,
        base_port,
        database_template=database_template,
        channels=channels,
        overrides=overrides,
    )
    if replicas == workers == 1:
        services = start_all(specs, var / "logs", timeout)
    else:
        services = start_scaled(var, specs, replicas, workers, base_port, timeout)
    try:
        wait_config(services[0] if replicas == workers == 1 else _analyzer(services), timeout)
    except BaseException:
        stop(services)
        raise
    return services


def _analyzer(services: Sequence[Service]) -> Service:
    """The analyzer's public entry among the started services (its HAProxy frontend when
    scaled)."""
    return next(s for s in services if s.name in ("analyzer", "haproxy:analyzer"))


def migrate(specs: Sequence[ServiceSpec]) -> None:
    """Bring every service's database to the latest schema here, before its processes start:
    each process migrates at start too, and concurrent first migrations of one empty database
    would race (two processes creating the same table); on a migrated database they are no-ops.
    """
    import analyzer
    import shuffler
    from runtime import db

    for spec in specs:
        shuffler_side = spec.command[0] == "shuffler"
        package = shuffler if shuffler_side else analyzer
        url = spec.env[
            "ESA_SHUFFLER_DATABASE_URL" if shuffler_side else "ESA_ANALYZER_DATABASE_URL"
        ]
        engine = db.make_engine(url)
        try:
            db.wait_for(engine)
            db.upgrade(engine, Path(str(package.__file__)).parent / "migrations")
        finally:
            engine.dispose()


def start_scaled(
    var: Path,
    specs: Sequence[ServiceSpec],
    replicas: int,
    workers: int,
    base_port: int,
    timeout: float,
) -> list[Service]:
    """Write ``var/haproxy.cfg``, migrate every database (:func:`migrate`), start every
    process, then HAProxy; returns the processes and one entry per public frontend (all
    sharing HAProxy's process) once every frontend answers ``/readyz``.

    Raises:
        LaunchError: haproxy is missing or refused its configuration, or a service did not
            become ready (nothing is left running).
    """
    processes, frontends = scale(specs, replicas, workers, base_port)
    logs, started = var / "logs", []
    try:
        config = haproxy.write_config(var / "haproxy.cfg", frontends)
        migrate(specs)
        started += start_all(processes, logs, timeout)
        with stopping.held():  # a stop arriving meanwhile waits until HAProxy is recorded
            proxy = haproxy.start(config, logs / "haproxy.log")
            _started(proxy)
            started += [
                Service(
                    name=f"haproxy:{f.name}",
                    url=f"http://127.0.0.1:{f.port}",
                    process=proxy,
                    log=logs / "haproxy.log",
                )
                for f in frontends
            ]
        wait_ready(started, timeout)
    except haproxy.HaproxyError as error:
        stop(started)
        raise LaunchError(str(error)) from error
    except BaseException:
        stop(started)
        raise
    return started


#: A process behind HAProxy that dies more often than this within :data:`CRASH_WINDOW` seconds
#: is crash-looping: :func:`serve_forever` gives up and stops everything.
MAX_DEATHS = 5
CRASH_WINDOW = 60.0
#: How long a restarted process may take to answer ``/readyz`` (as long as at start). It
#: restarts in a thread of its own, so the others stay supervised meanwhile.
RESTART_TIMEOUT = 60.0
#: The processes :func:`scale` starts: ``analyzer.w<n>`` and ``shuffler-<i>.r<n>``.
_SCALED_NAME = re.compile(r"^(?P<service>analyzer|shuffler-\d+)\.[rw]\d+$")


def print_status(message: str) -> None:
    """One line of supervision news on stderr, with the time of day (``esa up``'s console)."""
    stopping.say(message)


def siblings(service: Service, services: Sequence[Service]) -> list[Service]:
    """The other processes serving what ``service`` serves behind HAProxy (the other replicas
    of its shuffler, the other analyzer workers); empty when it is the only one, outside a
    scaled layout, or HAProxy itself."""
    mine = _SCALED_NAME.match(service.name)
    if mine is None:
        return []
    return [
        other
        for other in services
        if other is not service
        and (match := _SCALED_NAME.match(other.name)) is not None
        and match["service"] == mine["service"]
    ]


@dataclass
class Supervisor:
    """Restarts a process that has siblings behind HAProxy when it dies (in a thread: one slow
    restart hides no other death) and decides when restarting cannot help: HAProxy or a process
    without siblings died, a process crash-loops, or a restart did not become ready."""

    services: list[Service]
    report: Callable[[str], None] = print_status
    max_deaths: int = MAX_DEATHS
    window: float = CRASH_WINDOW
    restart_timeout: float = RESTART_TIMEOUT
    deaths: dict[str, deque[float]] = field(default_factory=dict)
    restarting: dict[str, threading.Thread] = field(default_factory=dict)
    #: Why a restart failed, by process name (written by the restart threads).
    failures: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """One look at every process: restart the dead ones that can be restarted.

        Raises:
            LaunchError: a death that a restart cannot help (nothing is stopped here).
        """
        self._finished_restarts()
        for service in self.services:
            if service.name not in self.restarting and service.process.poll() is not None:
                self._died(service)

    def join(self) -> None:
        """Wait for the restarts under way (each ends once its process is stopped or ready)."""
        for thread in self.restarting.values():
            thread.join(self.restart_timeout + 15)

    def _died(self, service: Service) -> None:
        code, others = service.process.returncode, siblings(service, self.services)
        if not others or service.spec is None:
            raise LaunchError(
                f"{service.name} stopped unexpectedly (exit code {code}); the end of its "
                f"log:\n{service.log_tail()}"
            )
        now, times = time.monotonic(), self.deaths.setdefault(service.name, deque())
        times.append(now)
        while times[0] < now - self.window:
            times.popleft()
        if len(times) > self.max_deaths:
            raise LaunchError(
                f"{service.name} died {len(times)} times within {self.window:.0f} s (a crash "
                f"loop; last exit code {code}); the end of its log:\n{service.log_tail()}"
            )
        meanwhile = (
            "HAProxy sends its requests to the others meanwhile"
            if any(o.name not in self.restarting and o.process.poll() is None for o in others)
            else "none of the others is up either: HAProxy answers 503 until one is"
        )
        self.report(f"{service.name} exited (code {code}); restarting it ({meanwhile})")
        thread = threading.Thread(
            target=self._restart, args=(service,), name=f"restart {service.name}", daemon=True
        )
        self.restarting[service.name] = thread
        thread.start()

    def _restart(self, service: Service) -> None:
        """In a restart thread: :meth:`Service.restart`, its failure kept for :meth:`check`."""
        try:
            service.restart(self.restart_timeout)
        except LaunchError as error:
            self.failures[service.name] = str(error)

    def _finished_restarts(self) -> None:
        """Report the restarts that ended; one that failed with its process still running (not
        ready in time) cannot be helped, one whose process exited again is a death."""
        for name, thread in list(self.restarting.items()):
            if thread.is_alive():
                continue
            del self.restarting[name]
            service = next(s for s in self.services if s.name == name)
            failure = self.failures.pop(name, None)
            if failure is None:
                self.report(f"{name} is ready again ({service.url})")
            elif service.process.poll() is None:
                raise LaunchError(f"{name} did not come back after a restart: {failure}")


def serve_forever(services: list[Service], report: Callable[[str], None] = print_status) -> None:
    """Block until a death a restart cannot help, or until Ctrl-C / SIGTERM / SIGHUP
    (:class:`services.tools.stopping.Stopped`, raised through once everything is stopped: the
    command ends as :func:`services.tools.stopping.stops_cleanly` says); stop everything first.

    A process with siblings behind HAProxy (a shuffler replica ``shuffler-<i>.r<n>``, an
    analyzer worker ``analyzer.w<n>``) that dies is restarted on its port (HAProxy sends its
    requests to the others meanwhile; ``report`` tells of it). HAProxy dying, a process
    without siblings dying (every single-process layout), a process dying more than
    :data:`MAX_DEATHS` times within :data:`CRASH_WINDOW` seconds, or a restarted process not
    ready within :data:`RESTART_TIMEOUT` seconds stops everything.

    Raises:
        LaunchError: what died and why restarting it did not help.
        stopping.Stopped: a stopping signal arrived.
    """
    supervisor = Supervisor(services=services, report=report)
    try:
        with stopping.raising():
            while True:
                supervisor.check()
                time.sleep(0.2)
    finally:
        stop(services)
        supervisor.join()  # a restart may have started its process after that stop
        stop(services)
