"""HAProxy's retry policy (issue 17, :data:`runtime.haproxy.RETRY_POLICY`): a replica
that dies under load costs its clients nothing they can see.

One trust domain as ``esa up --replicas 3 --database-url-template`` starts it (three shuffler
processes on one PostgreSQL database behind the real HAProxy, :func:`services.cli.launcher.up`).
Client threads enroll and contribute through HAProxy without retrying anything themselves: every
enrolment must answer 200 and every contribution 202 (or 409 ``replayed_nonce``, a resend of a
contribution the dead replica had committed: the SDK and the load generator read it as
delivered).

* Replica 1 is killed (SIGKILL) under load: requests in flight on it, and those sent to it
  before the health check takes it out (connection refused), are resent to another replica.
* Replica 2 is stopped (SIGSTOP), so the requests HAProxy sends it hang unanswered, and
  killed 2.5 s later, before its health check (2 s per try, 2 tries) takes it out: every hung
  request is resent (``empty-response``) and answered by replica 3. At least one request spans
  the kill (sent ≥ 1 s before it, answered after: it hung on replica 2). Each of the 8 client
  threads sends on until one of its requests hangs there, dozens a second each hashed to
  replica 2 with probability about 1/2: none hanging is out of reach.

Afterwards the database holds exactly the contributions acknowledged: none lost, none stored
twice (the nonce is unique, so a resend can at most be refused as a replay). The config text
tests check that ``esa up``'s and the compose profile's HAProxy configurations carry the same
policy, written once.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from sqlalchemy import func, select

from common.envelope import (
    Contribution,
    load_x25519_public,
    new_nonce,
    seal_contribution,
)
from runtime import db, haproxy
from services.cli import launcher
from shuffler import tables

from ..support import LONG_EPOCH_CHANNEL, TEST_SHUFFLER_SETTINGS
from .forge import FreshReports

ROOT = Path(__file__).resolve().parents[2]
CHANNEL = LONG_EPOCH_CHANNEL
SID = "shuffler-1"
REPLICAS = 3
THREADS = 8
OCTETS = "application/octet-stream"
#: Seconds a stopped replica hangs before it is killed (before its health check fails).
STOPPED_SECONDS = 2.5


@dataclass
class Requests:
    """Every request the clients sent: (path, sent, answered, status or error)."""

    done: list[tuple[str, float, float, str]] = field(default_factory=list)
    landed: int = 0
    replayed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, path: str, sent: float, outcome: str) -> None:
        with self.lock:
            self.done.append((path, sent, time.monotonic(), outcome))
            if path == "/v1/contributions" and outcome in ("202", "409 replayed_nonce"):
                self.landed += 1
                self.replayed += outcome != "202"

    def unexpected(self) -> list[tuple[str, float, float, str]]:
        good = {"/v1/enroll": ("200",), "/v1/contributions": ("202", "409 replayed_nonce")}
        return [r for r in self.done if r[3] not in good[r[0]]]

    def since(self, moment: float) -> int:
        """Contributions acknowledged after ``moment``."""
        return sum(1 for r in self.done if r[0] == "/v1/contributions" and r[2] > moment)


def _skip_without_haproxy() -> None:
    try:
        haproxy.binary()
    except haproxy.HaproxyError as error:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(error))
        pytest.skip(str(error))


@pytest.fixture
def domain(tmp_path: Path, postgres_template: str) -> Iterator[dict[str, launcher.Service]]:
    """``shuffler-1`` as 3 replicas behind HAProxy (and the analyzer ``esa up`` starts)."""
    _skip_without_haproxy()
    overrides = {**TEST_SHUFFLER_SETTINGS, "ESA_SHUFFLER_ENROLL_PER_MINUTE": "600000"}
    services = launcher.up(
        tmp_path,
        1,
        launcher.free_base_port(launcher.scaled_ports(1, REPLICAS, 1)),
        timeout=90,
        database_template=postgres_template,
        replicas=REPLICAS,
        channels=[CHANNEL],
        overrides=overrides,
    )
    try:
        yield {service.name: service for service in services}
    finally:
        for service in services:  # a stopped replica cannot be terminated politely
            if service.process.poll() is None:
                os.kill(service.process.pid, signal.SIGCONT)
        launcher.stop(services)


def _sealed_fragments(analyzer_url: str) -> FreshReports:
    """20 k-RAPPOR reports, sealed afresh for each contribution that takes one."""
    # Bound to the one epoch the test reports in (10^8-second epochs) and the default crowd.
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    return FreshReports.of(analyzer_url, CHANNEL, epoch, range(20))


def _send(
    client: httpx.Client, path: str, requests: Requests, **kwargs: object
) -> httpx.Response | None:
    """One POST, never retried here: its outcome is recorded as the client saw it."""
    sent = time.monotonic()
    try:
        answer = client.post(path, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as error:
        requests.record(path, sent, f"{type(error).__name__}: {error}")
        return None
    outcome = str(answer.status_code)
    if answer.status_code == 409:
        outcome += f" {answer.json().get('error')}"
    requests.record(path, sent, outcome)
    return answer


def _client_loop(
    url: str,
    key: X25519PublicKey,
    pool: FreshReports,
    stop: threading.Event,
    requests: Requests,
) -> None:
    """Fresh clients one after another: enroll, then one contribution with a fresh nonce."""
    epoch = int(time.time() // CHANNEL.epoch_seconds)
    with httpx.Client(base_url=url, timeout=60) as client:
        n = 0
        while not stop.is_set():
            n += 1
            enrolled = _send(client, "/v1/enroll", requests)
            if enrolled is None or enrolled.status_code != 200:
                continue
            contribution = Contribution(
                channel_id=CHANNEL.id,
                crowd_id="",
                epoch=epoch,
                nonce=new_nonce(),
                fragments=pool[n % len(pool)],
            )
            headers = {
                "Authorization": f"Bearer {enrolled.json()['client_token']}",
                "Content-Type": OCTETS,
            }
            body = seal_contribution(contribution, SID, key)
            _send(client, "/v1/contributions", requests, content=body, headers=headers)


def _stored(postgres_template: str) -> int:
    engine = db.make_engine(postgres_template.replace("{service}", "shuffler_1"))
    try:
        with engine.connect() as conn:
            query = select(func.count()).select_from(tables.contributions)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def _clients(
    domain: dict[str, launcher.Service], requests: Requests, stop: threading.Event
) -> list[threading.Thread]:
    """:data:`THREADS` client loops through the trust domain's HAProxy (not started yet)."""
    front = domain[f"haproxy:{SID}"].url
    config = httpx.get(front + "/v1/config", timeout=30).json()
    key = load_x25519_public(base64.b64decode(config["public_key"]))
    pool = _sealed_fragments(domain["haproxy:analyzer"].url)
    return [
        threading.Thread(target=_client_loop, args=(front, key, pool, stop, requests))
        for _ in range(THREADS)
    ]


def test_a_replica_killed_under_load_costs_its_clients_nothing(
    domain: dict[str, launcher.Service], postgres_template: str
) -> None:
    requests, stop = Requests(), threading.Event()
    threads = _clients(domain, requests, stop)
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        first_kill = time.monotonic()  # before kill(), which also waits for the exit
        domain[f"{SID}.r1"].kill()  # in flight, then refused until the check takes it out
        time.sleep(2.0)
        stopped = domain[f"{SID}.r2"].process.pid
        os.kill(stopped, signal.SIGSTOP)  # what HAProxy sends it now hangs unanswered
        time.sleep(STOPPED_SECONDS)
        second_kill = time.monotonic()
        domain[f"{SID}.r2"].kill()  # the hung requests: connection closed, no answer
        time.sleep(1.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(90)
    assert not requests.unexpected(), requests.unexpected()[:5]
    # Replica 3 alone went on taking contributions after both kills.
    assert requests.since(first_kill) > 0 and requests.since(second_kill + 0.5) > 0
    # Requests that hung on the stopped replica were resent and answered after its kill.
    spanning = [r for r in requests.done if r[1] < second_kill - 1.0 and r[2] > second_kill]
    assert spanning, "no request was in flight on the stopped replica when it was killed"
    # None lost, none stored twice: the database holds exactly what was acknowledged.
    assert _stored(postgres_template) == requests.landed


def test_a_stopped_replica_costs_its_clients_at_most_the_device_timeout(
    domain: dict[str, launcher.Service], postgres_template: str
) -> None:
    """Replica 2 is stopped (SIGSTOP) for longer than :data:`runtime.haproxy.DEVICE_TIMEOUT`
    and then continued, never killed (a paused VM, a long GC, a process stopped by a debugger):
    the requests it had taken are resent to another replica once they waited that long
    (``response-timeout``), so every one is answered while it is still stopped; when it
    continues it finds them answered (its own late commits refused: the nonce is unique), and
    the database holds exactly what was acknowledged."""
    requests, stop = Requests(), threading.Event()
    threads = _clients(domain, requests, stop)
    timeout = float(haproxy.DEVICE_TIMEOUT.removesuffix("s"))
    stopped = domain[f"{SID}.r2"].process.pid
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        os.kill(stopped, signal.SIGSTOP)
        paused = time.monotonic()
        time.sleep(timeout + 4.0)
        resumed = time.monotonic()  # before SIGCONT: what is answered before it was not its
        os.kill(stopped, signal.SIGCONT)
        time.sleep(2.0)
    finally:
        os.kill(stopped, signal.SIGCONT)
        stop.set()
        for thread in threads:
            thread.join(90)
    assert not requests.unexpected(), requests.unexpected()[:5]
    waited = [r for r in requests.done if paused <= r[1] and r[2] - r[1] >= timeout - 0.5]
    assert waited, "no request reached the stopped replica (none waited the device timeout)"
    assert all(r[2] < resumed for r in waited if r[1] < resumed - timeout - 1.0)
    assert requests.since(paused + timeout + 1.0) > 0  # the load went on around it
    assert _stored(postgres_template) == requests.landed


def test_esa_up_and_compose_carry_one_retry_policy(tmp_path: Path) -> None:
    """The ``defaults`` of ``esa up``'s configuration and of every compose configuration hold
    :data:`~runtime.haproxy.RETRY_POLICY` (written once, in render), and
    ``haproxy -c`` accepts ``esa up``'s."""
    frontends = [
        haproxy.Frontend("analyzer", 18000, (18010, 18011), shuffler=False),
        haproxy.Frontend(SID, 18001, (18012, 18013), shuffler=True),
    ]
    texts = [haproxy.render(frontends)]
    texts += [(ROOT / "deploy" / "haproxy" / f"shuffler-{i}.cfg").read_text() for i in (1, 2, 3)]
    for text in texts:
        defaults = text.split("\ndefaults\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert [line for line in defaults if line in haproxy.RETRY_POLICY] == list(
            haproxy.RETRY_POLICY
        )
        retries = [x for x in text.splitlines() if "retry-on" in x or "redispatch" in x]
        assert set(retries) - set(haproxy.RETRY_POLICY) <= {haproxy.DEVICE_RETRY}
        # a shuffler's two device routes (enrolment, contributions) add the answer timeout
        assert retries.count(haproxy.DEVICE_RETRY) == (2 if "-enroll" in text else 0)
    assert "retry-on conn-failure empty-response" in haproxy.RETRY_POLICY[-1]
    # The analyzer resends only idempotent POSTs after they reached a worker.
    assert (
        "    http-request disable-l7-retry if METH_POST !{ path /v1/batches }"
        in texts[0].splitlines()
    )
    assert "disable-l7-retry" not in "".join(texts[1:])  # shuffler routes: all resendable
    _skip_without_haproxy()
    assert haproxy.write_config(tmp_path / "haproxy.cfg", frontends).exists()


def test_answers_haproxy_writes_itself_are_the_services_json(tmp_path: Path) -> None:
    """With no live process behind it, HAProxy answers 503 itself: the ``{"error", "detail"}``
    JSON every route documents, with ``Retry-After``, not its HTML page (an outside attack
    found the HTML, which also told the client it met the balancer)."""
    _skip_without_haproxy()
    base = launcher.free_base_port(3)
    config = haproxy.write_config(
        tmp_path / "haproxy.cfg", [haproxy.Frontend(SID, base, (base + 1, base + 2), True)]
    )
    process = haproxy.start(config, tmp_path / "haproxy.log")
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                answer = httpx.get(f"http://127.0.0.1:{base}/readyz", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "haproxy did not start"
                time.sleep(0.1)
        assert answer.status_code == 503
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["retry-after"] == "1"
        assert set(answer.json()) == {"error", "detail"} and answer.json()["error"] == "unavailable"
        assert "<html" not in answer.text.lower()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
