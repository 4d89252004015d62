"""HAProxy in front of replicated services: configuration and process.

One HTTP frontend per public address (the analyzer, each shuffler trust domain), balancing over
that service's processes on loopback with an active ``GET /readyz`` health check. Shuffler
frontends hash on the ``Authorization`` header (enrolment on the source address), so each
replica's in-memory per-client rate limit holds; the analyzer's workers share round-robin.
:data:`RETRY_POLICY` resends a request whose process refused the connection or closed it without
a byte of answer, to another process, on the routes where a resend cannot count twice.

Why each route may or may not be resent, and the health check and forwarding in detail:
docs/architecture.md, "Runtime: HAProxy and the server".
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.http import error_body

#: The address HAProxy binds its frontends to and reaches the processes from: the one the
#: processes behind it trust for ``X-Forwarded-For`` (``trusted_proxies``).
ADDRESS = "127.0.0.1"
#: Where Debian's package puts the binary (``/usr/sbin`` is not on every user's PATH).
DEBIAN_BINARY = Path("/usr/sbin/haproxy")
#: Seconds between health checks of one backend process.
CHECK_INTERVAL = "500ms"
#: How long one check waits for ``/readyz`` to answer. Without it the wait is the interval,
#: and on two cores at a load average near 12 a sole replica answering in 518 ms was taken
#: out (every request then answered 503) though it was serving. A killed process is taken out
#: as fast either way (its port refuses the connection); a hung one after about 5 s.
CHECK_TIMEOUT = "2s"
#: How long one request may take end to end (a batch part POST may take 30 s at the analyzer).
SERVER_TIMEOUT = "120s"
#: The retry policy of every frontend (``defaults`` lines; why each route may be resent:
#: docs/architecture.md, "Runtime: HAProxy and the server").
RETRY_POLICY = (
    "    option http-buffer-request",
    "    option redispatch 1",
    "    retries 3",
    "    retry-on conn-failure empty-response",
)
#: The answers HAProxy writes itself (a request it cannot parse or that timed out, no live
#: process): the services' ``{"error", "detail"}`` JSON instead of HAProxy's HTML pages, which
#: would break the documented error contract and tell a client it met the balancer. 503 asks to
#: come back later, like the services' own 503s. Not covered: a request HAProxy's HTTP/1 parser
#: rejects before it is a request (a header block over ``tune.bufsize``, invalid framing) still
#: gets HAProxy's built-in 400 page; that needs ``errorfile`` files beside the configuration.
ERROR_ANSWERS = (
    (400, "malformed", "the request is not valid HTTP"),
    (403, "forbidden", "the request was refused"),
    (408, "timeout", "the request did not arrive in time"),
    (500, "internal", "the load balancer failed"),
    (501, "not_implemented", "the request method or encoding is not supported"),
    (502, "bad_gateway", "the service closed the connection without a valid answer"),
    (503, "unavailable", "no process of the service is available; retry later"),
    (504, "timeout", "the service did not answer in time"),
)


def error_lines() -> list[str]:
    """``http-error`` lines (``defaults``) answering :data:`ERROR_ANSWERS` as JSON."""
    lines = []
    for status, code, detail in ERROR_ANSWERS:
        assert "'" not in detail, detail  # inside HAProxy's single quotes
        body = error_body(code, detail).decode()
        retry = ' hdr Retry-After "1"' if status == 503 else ""
        lines.append(
            f"    http-error status {status} content-type application/json string '{body}'{retry}"
        )
    return lines


#: How long a device's request (an enrolment, a contribution) may wait for its process's
#: answer before HAProxy sends it to another replica (a process stopped, hung or stalled: its
#: health check takes it out only after ~1-3 s, and the requests it had taken would otherwise
#: wait for it, up to :data:`SERVER_TIMEOUT`): the SDK's own timeout, past which a device
#: gives up anyway. A resend is never counted twice (docs/architecture.md, "Runtime: HAProxy
#: and the server").
DEVICE_TIMEOUT = "10s"
#: The device routes' retries: :data:`RETRY_POLICY`'s, and an answer not begun within
#: :data:`DEVICE_TIMEOUT`.
DEVICE_RETRY = "    retry-on conn-failure empty-response response-timeout"

#: Analyzer POSTs that may be resent after reaching a process (idempotent); any other POST
#: is resent only on a refused connection.
ANALYZER_RESENDABLE = ("/v1/batches",)


class HaproxyError(RuntimeError):
    """HAProxy is missing, or refused its configuration."""


@dataclass(frozen=True, slots=True)
class Frontend:
    """One public address: ``name`` on 127.0.0.1:``port`` over ``backends`` (loopback ports);
    ``shuffler`` picks the sticky balancing of a shuffler trust domain."""

    name: str
    port: int
    backends: tuple[int, ...]
    shuffler: bool


def binary() -> Path:
    """The ``haproxy`` executable.

    Raises:
        HaproxyError: it is not installed (with how to install it).
    """
    found = shutil.which("haproxy")
    if found:
        return Path(found)
    if DEBIAN_BINARY.exists():
        return DEBIAN_BINARY
    raise HaproxyError(
        "haproxy is not installed: replicas and analyzer workers run behind it "
        "(Debian/Ubuntu: apt-get install haproxy)"
    )


def _backend(
    name: str,
    balance: str,
    ports: Sequence[int],
    track: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """One backend over ``ports``, each server health-checked on ``/readyz``, or with ``track``
    (another backend's name) following that backend's checks of the same process instead of
    checking it again: the enrolment and contributions backends of a trust domain track its
    replicas backend, so each process answers one check per interval, not three; ``extra``:
    more lines of the backend (its own timeout and retries)."""
    lines = [
        f"backend {name}",
        f"    balance {balance}",
        *extra,
        "    hash-type consistent",
        "    option httpchk",
        "    http-check send meth GET uri /readyz",
        "    http-check expect status 200",
        f"    default-server inter {CHECK_INTERVAL} fall 2 rise 2",
    ]
    for port in ports:
        how = "check" if track is None else f"track {track}/p{port}"
        lines.append(f"    server p{port} {ADDRESS}:{port} {how}")
    return lines


def render(frontends: Sequence[Frontend]) -> str:
    """The whole ``haproxy.cfg`` for these frontends."""
    lines = [
        "# Generated by `esa up` (runtime/haproxy.py); rewritten at every start.",
        "global",
        "    maxconn 4096",
        "defaults",
        "    mode http",
        "    option forwardfor",
        *RETRY_POLICY,
        *error_lines(),
        "    timeout connect 2s",
        f"    timeout check {CHECK_TIMEOUT}",
        "    timeout client 120s",
        f"    timeout server {SERVER_TIMEOUT}",
        "    timeout http-request 30s",
    ]
    for f in frontends:
        lines += ["", f"frontend {f.name}", f"    bind {ADDRESS}:{f.port}"]
        if f.shuffler:
            lines += _shuffler(f)
        else:
            resendable = " ".join(ANALYZER_RESENDABLE)
            lines += [
                f"    http-request disable-l7-retry if METH_POST !{{ path {resendable} }}",
                f"    default_backend {f.name}-workers",
                "",
            ]
            lines += _backend(f"{f.name}-workers", "roundrobin", f.backends)
    return "\n".join(lines) + "\n"


def _shuffler(f: Frontend) -> list[str]:
    """A shuffler trust domain's routes: enrolment hashed on the source address, device
    contributions on the token, both resent elsewhere when a process does not answer within
    :data:`DEVICE_TIMEOUT`; everything else (admin, metrics, config) on the token."""
    replicas = f"{f.name}-replicas"
    device = (f"    timeout server {DEVICE_TIMEOUT}", DEVICE_RETRY)
    return [
        f"    use_backend {f.name}-enroll if {{ path /v1/enroll }}",
        f"    use_backend {f.name}-contributions if METH_POST {{ path /v1/contributions }}",
        f"    default_backend {replicas}",
        "",
        *_backend(replicas, "hdr(Authorization)", f.backends),
        "",
        *_backend(f"{f.name}-enroll", "source", f.backends, replicas, device),
        "",
        *_backend(f"{f.name}-contributions", "hdr(Authorization)", f.backends, replicas, device),
    ]


def write_config(path: Path, frontends: Sequence[Frontend]) -> Path:
    """Write and validate ``haproxy.cfg`` (``haproxy -c``).

    Raises:
        HaproxyError: haproxy is missing or refuses the configuration.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(frontends))
    check = subprocess.run(
        [str(binary()), "-c", "-q", "-f", str(path)], capture_output=True, text=True, check=False
    )
    if check.returncode != 0:
        raise HaproxyError(f"haproxy refused {path}: {(check.stderr or check.stdout).strip()}")
    return path


def start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """Run haproxy in the foreground (``-db``) on ``config``, logging to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as handle:
        return subprocess.Popen(
            [str(binary()), "-db", "-f", str(config)],
            stdout=handle,
            stderr=handle,
            start_new_session=True,
        )
