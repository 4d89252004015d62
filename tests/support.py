"""Helpers for tests that run real service processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import TrustAnchors, sign_config, sign_descriptor
from common.envelope import key_id, public_bytes
from common.wire import (
    MAX_EPOCH_SECONDS,
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    DeviceBudget,
    HpkeKey,
    ShufflerDescriptor,
    SignedDescriptor,
    b64,
)
from runtime.server import uvicorn_options
from services.cli import launcher
from services.tools.catalogue import DELETION

#: A k-RR channel for load tests: one sealed fragment per report keeps the prepare phase short.
LOADTEST_PAGES = ChannelConfig(
    id="pages",
    mechanism="krr",
    params={"k": 16, "eps": 2.0},
    min_crowd=20,
    **DELETION,
    max_fragments=4,
    delta=1e-8,
)
#: A longitudinal channel of 4 periods of 4-second epochs: the phase lasts ~16 s.
LOADTEST_SERIES = ChannelConfig(
    id="abroad",
    mechanism="longitudinal",
    params={"d": 4, "k": 2, "eps": 4.0},
    epoch_seconds=4,
    min_crowd=5,
    **DELETION,
    max_fragments=1,
    delta=1e-8,
    display="series",
)
#: A k-RAPPOR channel whose epochs last 10^8 s, so a test never straddles an epoch boundary.
LONG_EPOCH_CHANNEL = ChannelConfig(
    id="homepage",
    mechanism="krappor",
    params={"k": 20, "eps": 4.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=5,
    eps_cr=4.0,
    delta_cr=1e-7,
    max_fragments=20,
    delta=1e-8,
    payload_size=16,
)
#: The admin bearer token of test deployments (``esa up``'s development default).
ADMIN_HEADERS = {"Authorization": "Bearer development"}

#: The admin and metrics tokens of test deployments started by :func:`start_deployment`: the
#: development default at every party, so tests address them with :data:`ADMIN_HEADERS`
#: (``esa up`` itself gives every party its own: tests/services/test_launcher.py, e2e tests
#: that run ``esa up``, ``esa demo`` or ``esa loadtest --up``, and the compose tests).
TEST_TOKENS = launcher.DEVELOPMENT_TOKENS


def own_token(var: Path, party: str, kind: str = launcher.ADMIN_TOKEN_FILE) -> str:
    """``party``'s own admin (or ``kind="metrics-token"``) token, as ``esa up`` /
    :func:`launcher.prepare` keeps it in ``var/keys/<party>/`` (a replica or worker uses its
    service's: ``shuffler-1`` for ``shuffler-1.r2``)."""
    return (var / "keys" / party / kind).read_text().strip()


def own_headers(var: Path, party: str, kind: str = launcher.ADMIN_TOKEN_FILE) -> dict[str, str]:
    """The ``Authorization`` header with ``party``'s own token (:func:`own_token`)."""
    return {"Authorization": f"Bearer {own_token(var, party, kind)}"}


def given_headers(spec: launcher.ServiceSpec, setting: str = "ADMIN_TOKEN") -> dict[str, str]:
    """The ``Authorization`` header with the token a service was given for ``setting``
    (``ESA_<ROLE>_<setting>``, else the file of ``..._FILE``): its own under ``esa up``, the
    development one under :func:`start_deployment`."""
    variable = f"ESA_{spec.command[0].upper()}_{setting}"
    token = spec.env.get(variable)
    if token is None:
        token = Path(spec.env[f"{variable}_FILE"]).read_text().strip()
    return {"Authorization": f"Bearer {token}"}


#: Analyzer settings of test deployments: an epoch not every shuffler delivered for closes 10 s
#: after its end (past a shuffler's 2 s grace and its forwarding; tests post to epochs long
#: over, or close current ones at the shufflers), looked for every fraction of a second.
TEST_ANALYZER_SETTINGS = {
    "ESA_ANALYZER_EPOCH_CLOSE_SECONDS": "10",
    "ESA_ANALYZER_EPOCH_CLOSE_POLL_SECONDS": "0.2",
}

#: Shuffler settings of test deployments: batch and forward within a fraction of a second.
TEST_SHUFFLER_SETTINGS = {
    "ESA_SHUFFLER_BATCH_INTERVAL_SECONDS": "0.2",
    "ESA_SHUFFLER_FORWARD_INTERVAL_SECONDS": "0.2",
    "ESA_SHUFFLER_BACKOFF_BASE_SECONDS": "0.2",
    "ESA_SHUFFLER_BACKOFF_CAP_SECONDS": "1.0",
    "ESA_SHUFFLER_CONFIG_REFRESH_SECONDS": "0.5",
}

#: A shuffler channel policy small enough for tests to fill and close groups quickly.
SMALL_CHANNEL = {
    "id": "homepage",
    "epoch_seconds": 3600,
    "min_crowd": 5,
    "eps_cr": 4.0,
    "delta_cr": 1e-7,
    "max_fragments": 4,
}


#: The TypeScript device SDK: its sources, lockfile, node_modules and build (dist/).
SDK_JS = Path(__file__).resolve().parents[1] / "sdk-js"


def _older_than(built: Path, sources: list[Path]) -> bool:
    """Whether ``built`` is missing or older than one of ``sources``."""
    if not built.exists():
        return True
    return built.stat().st_mtime < max(p.stat().st_mtime for p in sources)


def built_sdk_js() -> str:
    """Node, with sdk-js/ as ``make sdk-js`` leaves it: its lockfile installed (``npm ci``
    when node_modules is missing or older than package-lock.json) and built (``npm run build``
    when dist/ is older than a source). Skips without node and npm, fails under CI=true."""
    import pytest

    found = shutil.which("node")
    if found is None or shutil.which("npm") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("node and npm are needed for the TypeScript SDK's tests")
        pytest.skip("node and npm are not installed")
    lock = SDK_JS / "package-lock.json"
    if _older_than(SDK_JS / "node_modules" / ".package-lock.json", [lock]):
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=SDK_JS, check=True)
    sources = [*(SDK_JS / "src").rglob("*.ts"), SDK_JS / "scripts" / "bundle.mjs"]
    if _older_than(SDK_JS / "dist" / "esa-device-sdk.browser.js", sources):
        subprocess.run(["npm", "run", "build"], cwd=SDK_JS, check=True)
    return found


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for one service, or an address nobody listens on)."""
    return launcher.free_base_port(1)


@dataclass
class ServiceProcess:
    """A service started by the launcher (:mod:`services.cli.launcher`: the same command,
    base environment and readiness check as ``esa up``), with test settings as overrides."""

    spec: launcher.ServiceSpec
    log_path: Path
    service: launcher.Service | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def env(self) -> dict[str, str]:
        """Its environment; changes apply at the next :meth:`start`."""
        return self.spec.env

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        self.service = launcher.start(self.spec, self.log_path)
        try:
            launcher.wait_ready([self.service], timeout)
        except launcher.LaunchError as error:
            tail = self.service.log_tail(2000)
            raise RuntimeError(f"service did not start: {error}\n{tail}") from error
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, like a crash."""
        if self.service is not None:
            self.service.kill()

    def stop(self) -> None:
        if self.service is not None:
            launcher.stop([self.service])

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stopped however the test ends (a failed assertion leaves no process behind)."""
        self.stop()


def _spec(spec: launcher.ServiceSpec, env: dict[str, str]) -> launcher.ServiceSpec:
    """``spec`` with ``env`` applied; an empty value removes the variable (lists given inline
    replace the launcher's channel and registry files)."""
    merged = launcher.with_overrides(spec, env)
    return replace(merged, env={k: v for k, v in merged.env.items() if v != ""})


def end_process(process: subprocess.Popen[Any], grace: float = 30.0) -> None:
    """SIGTERM ``process`` if it still runs (our commands then stop what they started), and
    SIGKILL it after ``grace`` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


#: Settings of a shuffler that forwards to a bare :func:`receiver` (which serves no signed
#: config to follow): it batches under the channels it was given, as one with no analyzer key.
UNFOLLOWED = {"analyzer_key_file": ""}


def shuffler_process(
    tmp: Path,
    shuffler_id: str,
    channels: list[dict[str, Any]],
    database_url: str | None = None,
    **env: str,
) -> ServiceProcess:
    """Shuffler ``shuffler_id`` with its keys and SQLite file under ``tmp/<shuffler_id>/``."""
    index = int(shuffler_id.rsplit("-", 1)[1])
    database = database_url or f"sqlite:///{tmp / shuffler_id / 'db.sqlite'}"
    analyzer_url = env.pop("analyzer_url", "")
    spec = launcher.shuffler_spec(tmp, index, free_port(), analyzer_url, database)
    overrides = {
        "ESA_SHUFFLER_KEY_DIR": str(tmp / shuffler_id / "keys"),
        "ESA_SHUFFLER_CHANNELS": json.dumps(channels),
        "ESA_SHUFFLER_CHANNELS_FILE": "",
        **TEST_SHUFFLER_SETTINGS,
        **{f"ESA_SHUFFLER_{k.upper()}": v for k, v in env.items()},
    }
    return ServiceProcess(_spec(spec, overrides), tmp / f"{shuffler_id}.log")


def analyzer_process(
    tmp: Path,
    channels: list[dict[str, Any]],
    shufflers: list[dict[str, Any]],
    database_url: str | None = None,
    **env: str,
) -> ServiceProcess:
    """The analyzer with its keys and SQLite file under ``tmp/analyzer/``."""
    database = database_url or f"sqlite:///{tmp / 'analyzer' / 'db.sqlite'}"
    spec = launcher.analyzer_spec(tmp, free_port(), database)
    overrides = {
        "ESA_ANALYZER_KEY_DIR": str(tmp / "analyzer" / "keys"),
        "ESA_ANALYZER_CHANNELS": json.dumps(channels),
        "ESA_ANALYZER_SHUFFLERS": json.dumps(shufflers),
        "ESA_ANALYZER_CHANNELS_FILE": "",
        "ESA_ANALYZER_SHUFFLERS_FILE": "",
        **TEST_ANALYZER_SETTINGS,
        **{f"ESA_ANALYZER_{k.upper()}": v for k, v in env.items()},
    }
    return ServiceProcess(_spec(spec, overrides), tmp / "analyzer.log")


@dataclass
class Deployment:
    """An analyzer and K shufflers started by the launcher from one ``var`` folder."""

    var: Path
    analyzer: ServiceProcess
    shufflers: list[ServiceProcess]

    @property
    def signing_keys(self) -> dict[str, Ed25519PrivateKey]:
        """Each shuffler's batch-signing key (tests forge and replay batches with them)."""
        from common.envelope import load_or_create_ed25519

        keys = self.var / "keys"
        return {
            s.spec.name: load_or_create_ed25519(keys / s.spec.name / "signing.pem")
            for s in self.shufflers
        }

    @property
    def trust_file(self) -> Path:
        """The keys an app pins, one per party (``var/trust.json``)."""
        return self.var / launcher.TRUST_FILE

    def trust(self) -> TrustAnchors:
        """The pinned keys of :attr:`trust_file`."""
        return TrustAnchors.load(self.trust_file)

    def trusted_key(self) -> str:
        """The analyzer's config-signing key alone (``var/analyzer.pub``)."""
        return (self.var / "analyzer.pub").read_text().strip()

    def stop(self) -> None:
        for process in [*self.shufflers, self.analyzer]:
            process.stop()


#: Keys reloaded every half second and published two seconds after a rotation.
KEY_SETTINGS = {
    f"ESA_{role}_{name}": value
    for role in ("ANALYZER", "SHUFFLER")
    for name, value in (("KEY_RELOAD_SECONDS", "0.5"), ("KEY_ACTIVATION_SECONDS", "2"))
}


@contextmanager
def key_deployment(var: Path, channels: list[Any]) -> Iterator[Deployment]:
    """``esa up`` with two shufflers following the analyzer's config and reloading keys every
    half second (:data:`KEY_SETTINGS`), each party with its own tokens under ``var/keys``."""
    overrides = {**TEST_SHUFFLER_SETTINGS, **KEY_SETTINGS}
    base = launcher.free_base_port(3)
    specs = launcher.prepare(var, 2, base, channels=channels, overrides=overrides)
    processes = [ServiceProcess(spec, var / "logs" / f"{spec.name}.log") for spec in specs]
    running = Deployment(var, processes[0], processes[1:])
    try:
        for process in processes:
            process.start()
        assert processes[0].service is not None
        launcher.wait_config(processes[0].service, 60)
        yield running
    finally:
        running.stop()


def start_deployment(
    tmp: Path,
    channels: list[Any],
    analyzer_db: str | None = None,
    count: int = 3,
    env: dict[str, str] | None = None,
    own_tokens: bool = False,
) -> Deployment:
    """``esa up`` for tests: :func:`launcher.prepare` with these channels on free ports, each
    shuffler batching and forwarding fast; ``analyzer_db`` replaces the analyzer's SQLite;
    ``env``: more settings (whole variable names, ``ESA_ANALYZER_...``). Every party's admin
    and metrics token is :data:`TEST_TOKENS`, or with ``own_tokens`` its own, as ``esa up``
    keeps it in ``tmp/keys/<party>/`` (:class:`services.tools.credentials.Credentials`)."""
    tokens = {} if own_tokens else TEST_TOKENS
    overrides = {**TEST_SHUFFLER_SETTINGS, **TEST_ANALYZER_SETTINGS, **tokens, **(env or {})}
    if analyzer_db is not None:
        overrides["ESA_ANALYZER_DATABASE_URL"] = analyzer_db
    base = launcher.free_base_port(count + 1)
    specs = launcher.prepare(tmp, count, base, channels=channels, overrides=overrides)
    processes = [ServiceProcess(spec, tmp / "logs" / f"{spec.name}.log") for spec in specs]
    processes[0].start()
    for process in processes[1:]:
        process.start()
    assert processes[0].service is not None
    launcher.wait_config(processes[0].service, 60)
    return Deployment(tmp, processes[0], processes[1:])


def descriptor(
    signer: Ed25519PrivateKey,
    hpke: X25519PrivateKey,
    shuffler_id: str = "shuffler-1",
    url: str = "http://127.0.0.1:9",
    lifetime: int = 10**9,
) -> SignedDescriptor:
    """A shuffler's own signed descriptor (what ``GET /v1/descriptor`` serves)."""
    now = int(time.time())
    return sign_descriptor(
        ShufflerDescriptor(
            id=shuffler_id,
            url=url,
            keys=[
                HpkeKey(
                    key_id=key_id(hpke.public_key()).hex(),
                    public_key=b64(public_bytes(hpke.public_key())),
                )
            ],
            signing_key=b64(public_bytes(signer.public_key())),
            issued_at=now,
            expires_at=now + lifetime,
        ),
        signer,
    )


def registry_entry(shuffler_id: str, url: str, signer: Ed25519PrivateKey) -> dict[str, str]:
    """One shuffler in the analyzer's registry: where its descriptor is, the key pinned."""
    return {"id": shuffler_id, "url": url, "signing_key": b64(public_bytes(signer.public_key()))}


def close_epoch(deployment: Deployment, channel_id: str, epoch: int) -> None:
    """Close an epoch at every shuffler now, with its own admin token (batches are forwarded
    right away), then wait until the analyzer has opened every part it stored."""
    for process in deployment.shufflers:
        response = httpx.post(
            process.url + "/v1/admin/close",
            timeout=60,
            headers=given_headers(process.spec),
            json={"channel_id": channel_id, "epoch": epoch},
        )
        assert response.status_code == 200, response.text
    wait_until(lambda: unopened_parts(deployment.analyzer.url) == 0, timeout=60)


def unopened_parts(analyzer_url: str) -> float:
    """The analyzer's intake backlog (``esa_analyzer_parts_unopened``)."""
    text = httpx.get(analyzer_url + "/metrics", timeout=10).text
    found = re.search(r"^esa_analyzer_parts_unopened (\S+)$", text, re.MULTILINE)
    assert found is not None, "the analyzer exports no esa_analyzer_parts_unopened"
    return float(found.group(1))


@dataclass
class Receiver:
    """An analyzer endpoint whose answers the test sets (503, down, slow: faults a real
    analyzer cannot be made to show on cue); records every POSTed batch and acknowledges
    with a :class:`common.wire.BatchAck`."""

    port: int
    status: int = 201
    bodies: list[tuple[bytes, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def batch_ids(self) -> set[str]:
        return {json.loads(body)["batch_id"] for body, _ in self.bodies}


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test output clean (no line per request)."""

    def log_message(self, *args: object) -> None:
        pass

    def dribble(self, status: int, body: bytes, gap: float) -> float:
        """Answer ``status`` with ``body`` one byte every ``gap`` seconds (a slow peer; at once
        if ``gap`` is 0), until the whole body is out or the client hangs up; returns how long
        the answer was held."""
        start = time.monotonic()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if gap <= 0:
            self.wfile.write(body)
            return 0.0
        try:
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                readable, _, _ = select.select([self.connection], [], [], gap)
                if readable and not self.connection.recv(1):  # the client hung up
                    break
        except OSError:
            pass
        return time.monotonic() - start


@contextmanager
def handler_served(handler: type[BaseHTTPRequestHandler], port: int = 0) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 (``port``, or a free one) by a thread of its own while
    the block runs: a real HTTP peer whose answers the test writes. Yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


#: The example page (docs/sdk-js.md, "The example page").
EXAMPLE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "web"


@contextmanager
def example_page(site: Path, trust_file: Path, port: int = 0) -> Iterator[str]:
    """The example page served from ``site`` on 127.0.0.1 (``port``, or a free one) as
    docs/sdk-js.md says to serve it: its files, the browser bundle (:func:`built_sdk_js`
    builds it) and the deployment's trust file in one folder; files added to ``site`` later
    are served too. Yields the page's URL."""
    site.mkdir(parents=True, exist_ok=True)
    for name in ("index.html", "app.js"):
        shutil.copy(EXAMPLE_PAGE / name, site / name)
    shutil.copy(SDK_JS / "dist" / "esa-device-sdk.browser.js", site)
    shutil.copy(trust_file, site / "trust.json")

    class Site(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(site), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    with handler_served(Site, port) as url:
        yield url + "/index.html"


@contextmanager
def receiver(port: int | None = None) -> Iterator[Receiver]:
    state = Receiver(port or free_port())

    class Handler(QuietHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            state.bodies.append((body, self.headers.get("ESA-Signature", "")))
            self.send_response(state.status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            sent = json.loads(body)
            ack = {"batch_id": sent.get("batch_id", ""), "part": sent.get("part", 0)}
            self.wfile.write(json.dumps({**ack, "duplicate": False}).encode())

    with handler_served(Handler, state.port):
        yield state


def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError("condition not met in time")


@dataclass(frozen=True)
class OfflineConfig:
    """A signed collection config in a file, for a device with no deployment: one shuffler and
    the analyzer at port 9 (discard), so everything a device queues stays in its outbox; the
    private keys let a test open what it queued and sign other documents."""

    path: Path
    signer: Ed25519PrivateKey
    analyzer: X25519PrivateKey
    shuffler: X25519PrivateKey
    shuffler_signer: Ed25519PrivateKey

    @property
    def trusted_key(self) -> str:
        """The config-signing key to pin, base64."""
        return b64(public_bytes(self.signer.public_key()))

    @property
    def shuffler_keys(self) -> dict[str, str]:
        """The shuffler's signing key to pin, base64, by id."""
        return {"shuffler-1": b64(public_bytes(self.shuffler_signer.public_key()))}

    @property
    def trust_file(self) -> Path:
        """Both, as a trust file next to the config."""
        return self.path.with_name("trust.json")


def offline_config(
    tmp: Path, channels: list[ChannelConfig], overall: DeviceBudget | None = None
) -> OfflineConfig:
    """Sign ``channels`` (and an overall device budget) into ``tmp/config.json``, with the
    shuffler's own signed descriptor, and the keys to pin into ``tmp/trust.json``."""
    signer, analyzer = Ed25519PrivateKey.generate(), X25519PrivateKey.generate()
    shuffler, shuffler_signer = X25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    key = HpkeKey(
        key_id=key_id(analyzer.public_key()).hex(),
        public_key=b64(public_bytes(analyzer.public_key())),
    )
    now = int(time.time())
    config = CollectionConfig(
        issued_at=now,
        expires_at=now + 10**9,
        analyzer=AnalyzerInfo(
            url="http://127.0.0.1:9", keys=[key], signing_key=b64(public_bytes(signer.public_key()))
        ),
        shufflers=[descriptor(shuffler_signer, shuffler)],
        channels=channels,
        device_budget=overall,
    )
    path = tmp / "config.json"
    path.write_text(sign_config(config, signer).model_dump_json())
    found = OfflineConfig(
        path=path,
        signer=signer,
        analyzer=analyzer,
        shuffler=shuffler,
        shuffler_signer=shuffler_signer,
    )
    trust = TrustAnchors(signer.public_key(), {"shuffler-1": shuffler_signer.public_key()})
    found.trust_file.write_text(json.dumps(trust.to_json()))
    return found


@contextmanager
def served(app: Any) -> Iterator[int]:
    """``app`` under the services' uvicorn options, in a thread; yields its port."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="error", **uvicorn_options()
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def exchange(port: int, request: bytes, answers: int = 1) -> bytes:
    """``request`` sent, and what came back until the server closed or ``answers`` heads."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while answer.count(b"HTTP/1.1 ") < answers or not answer.endswith((b"\r\n\r\n", b"}")):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer
