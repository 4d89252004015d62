"""Anyone on the network holding the analyzer's ``POST /v1/batches`` open: a head naming a
registered shuffler (its id is public) and any base64 signature, one chunk of body, then nothing
or one byte a second. Before, such sockets took the intake slots of the id they claimed until
the body deadline, again and again (reconnecting at once, after every analyzer restart, in
every worker). Now a request takes a slot only with the shuffler's own signed head
(``ESA-Preauth``, common/preauth.py), refused 401 ``bad_preauth`` otherwise from the head
alone; and every body still has a whole deadline and a minimum rate (408 ``body_timeout``).

A real deployment (an analyzer and three shufflers) with short deadlines so the test takes
seconds; the honest part is shuffler-2's, sent by its own forwarder when an admin closes an
epoch there. Each attack prints one ATTACK line with its honest control from the same run.
"""

from __future__ import annotations

import base64
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.collection import verify_collection
from common.envelope import Contribution, load_x25519_public, new_nonce, seal_contribution
from common.preauth import preauth_header
from common.wire import MAX_EPOCH_SECONDS, ChannelConfig, b64

from ..support import Deployment, given_headers, start_deployment, wait_until
from .forge import MaliciousShuffler

#: The analyzer's deadlines in this deployment (the defaults are 10 s, 60 s, 1024 B/s, 5 s).
HEAD, BODY, RATE, GRACE = 2.0, 3.0, 256.0, 1.0
#: Contributions per group: enough that randomized deletion leaves more than min_crowd.
CROWD = 60


def _channel(name: str) -> ChannelConfig:
    """One report per contribution, deletion cheap enough that a group of 60 is released."""
    return ChannelConfig(
        id=name,
        mechanism="krr",
        params={"k": 16, "eps": 2.0},
        epoch_seconds=MAX_EPOCH_SECONDS,
        min_crowd=20,
        eps_cr=4.0,
        delta_cr=1e-7,
        min_fragments=1,
        max_fragments=1,
        delta=1e-8,
    )


CHANNELS = [
    _channel(name) for name in ("held-control", "held-one-id", "held-every-id", "held-own-id")
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    settings = {
        f"ESA_{service}_{name}": str(value)
        for service in ("ANALYZER", "SHUFFLER")
        for name, value in (
            ("HEAD_TIMEOUT_SECONDS", HEAD),
            ("BODY_TIMEOUT_SECONDS", BODY),
            ("BODY_MIN_RATE_BYTES", RATE),
            ("BODY_RATE_GRACE_SECONDS", GRACE),
        )
    }
    found = start_deployment(Path(tmp_path_factory.mktemp("held")), CHANNELS, env=settings)
    try:
        yield found
    finally:
        found.stop()


@dataclass
class Holder:
    """Sockets to ``POST /v1/batches`` claiming ``ids`` in turn, each a head (with ``preauth``
    as its ``ESA-Preauth``, if any) and 64 bytes of a chunked body's first chunk, then ``rate``
    bytes a second (0: nothing more), never the end; with ``reopen``, a socket is opened again
    as soon as it is answered or closed, until :meth:`stop`. Records how long each socket was
    held and the first line of what it was answered."""

    url: str
    ids: list[str]
    count: int
    rate: int = 0
    preauth: str | None = None
    reopen: bool = False
    held: list[float] = field(default_factory=list)
    answers: list[bytes] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Holder:
        """Open the sockets and return once the analyzer has answered one from each (its
        ``batches_rejected`` counters, read before and after, say so: no sleep)."""
        before = _refusals(self.url)
        for i in range(self.count):
            thread = threading.Thread(target=self._hold, args=(self.ids[i % len(self.ids)],))
            thread.start()
            self._threads.append(thread)
        wait_until(lambda: _refusals(self.url) >= before + self.count, timeout=60, interval=0.05)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _hold(self, shuffler: str) -> None:
        where = urlsplit(self.url)
        head = b"".join(
            [
                b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nESA-Shuffler: " + shuffler.encode(),
                b"\r\nESA-Signature: " + b64(os.urandom(64)).encode(),
                b"" if self.preauth is None else b"\r\nESA-Preauth: " + self.preauth.encode(),
                b"\r\nTransfer-Encoding: chunked\r\n\r\n400000\r\n" + b"x" * 64,
            ]
        )
        while not self._stop.is_set():
            with socket.create_connection((where.hostname, where.port), 60) as sock:
                sock.sendall(head)
                started = time.monotonic()
                answer = self._wait(sock)
                self.held.append(time.monotonic() - started)
                self.answers.append(answer.split(b"\r\n", 1)[0])
            if not self.reopen:
                return

    def _wait(self, sock: socket.socket) -> bytes:
        """The analyzer's answer, once its head is here or the socket is closed (sending
        ``rate`` bytes a second meanwhile)."""
        sock.settimeout(1.0)
        answer = b""
        while b"\r\n\r\n" not in answer:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if self._stop.is_set():
                    return answer
                if self.rate:
                    try:
                        sock.sendall(b"x" * self.rate)
                    except OSError:
                        return answer
                continue
            except OSError:
                return answer
            if not chunk:
                return answer
            answer += chunk
        return answer


def _refusals(url: str) -> float:
    """Every ``esa_analyzer_batches_rejected`` of the analyzer, whatever the reason."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("esa_analyzer_batches_rejected_total{")
    )


def _counted(url: str, name: str) -> float:
    """``esa_analyzer_batches_rejected{reason=name}``, or another ``esa_analyzer_<name>``
    counter (0 if absent)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(
            (
                f'esa_analyzer_batches_rejected_total{{reason="{name}"}} ',
                f"esa_analyzer_{name}_total ",
            )
        ):
            return float(line.split()[-1])
    return 0.0


def _contribute(deployment: Deployment, channel: ChannelConfig, shuffler: int) -> int:
    """``CROWD`` honest contributions of ``channel`` to shuffler number ``shuffler`` (0-based)
    from freshly enrolled devices, their fragments sealed to the analyzer; the epoch."""
    document = httpx.get(deployment.analyzer.url + "/v1/config", timeout=10).json()
    config = verify_collection(document, deployment.trust(), time.time())
    target = config.shufflers[shuffler]
    key = load_x25519_public(base64.b64decode(target.public_key))
    epoch = int(time.time() // channel.epoch_seconds)
    encoder = MaliciousShuffler(deployment, target.id)
    fragments = encoder.fragments(channel.id, epoch, [i % 16 for i in range(CROWD)])
    with httpx.Client(timeout=10) as http:
        for fragment in fragments:
            token = http.post(target.url + "/v1/enroll").json()["client_token"]
            contribution = Contribution(
                channel_id=channel.id,
                crowd_id="",
                epoch=epoch,
                nonce=new_nonce(),
                fragments=(base64.b64decode(fragment),),
            )
            answer = http.post(
                target.url + "/v1/contributions",
                content=seal_contribution(contribution, target.id, key),
                headers={
                    "Authorization": f"Bearer {token}",
                    "Content-Type": "application/octet-stream",
                },
            )
            assert answer.status_code == 202, answer.text
    return epoch


def _received(deployment: Deployment, channel: ChannelConfig) -> bool:
    listing = httpx.get(deployment.analyzer.url + "/v1/channels", timeout=10).json()
    return any(c["id"] == channel.id and c["epochs"] for c in listing["channels"])


def _delivery(deployment: Deployment, channel: ChannelConfig, epoch: int) -> float:
    """Seconds from shuffler-2's epoch close (its forwarder sends the part at once, then
    retries) until the analyzer has stored its part."""
    shuffler = deployment.shufflers[1]
    started = time.monotonic()
    closed = httpx.post(
        shuffler.url + "/v1/admin/close",
        json={"channel_id": channel.id, "epoch": epoch},
        headers=given_headers(shuffler.spec),
        timeout=120,
    )
    assert closed.status_code == 200, closed.text
    # 1, or 0 when the shuffler's own batching round saw the close first and evaluated the group
    assert closed.json()["groups_evaluated"] in (0, 1)
    wait_until(lambda: _received(deployment, channel), timeout=60, interval=0.05)
    return time.monotonic() - started


def _cuts(holder: Holder) -> str:
    codes = sorted({answer.decode(errors="replace") for answer in holder.answers})
    return f"{len(holder.held)} sockets held {max(holder.held):.2f} s at most ({', '.join(codes)})"


def _forged_preauth(shuffler: str) -> str:
    """A well-formed ``ESA-Preauth`` for a 4 MB body claiming ``shuffler``, signed now by a key
    that is not the shuffler's (the attacker has only public keys)."""
    return preauth_header(shuffler, os.urandom(4 * 1024 * 1024), Ed25519PrivateKey.generate(),
                          time.time())  # fmt: skip


def test_sockets_without_the_shufflers_head_never_take_a_slot(deployment: Deployment) -> None:
    """Nothing but the shuffler's own ``ESA-Preauth`` takes one of its intake slots: sockets
    claiming a shuffler without it, or with one signed by another key, are refused 401
    ``bad_preauth`` from the head alone, so none of them waits for a deadline, no honest part
    is ever answered ``busy``, and shuffler-2's part is stored while they keep coming."""
    control_channel, one_id, every_id, own_id = CHANNELS
    url = deployment.analyzer.url
    epochs = [_contribute(deployment, channel, 1) for channel in CHANNELS]
    busy_before, cut_before = _counted(url, "busy"), _counted(url, "requests_body_timeout")
    control = _delivery(deployment, control_channel, epochs[0])

    # 1a, as reported: 8 sockets claiming shuffler-1, no ESA-Preauth, reopened when answered.
    reported = Holder(url=url, ids=["shuffler-1"], count=8, reopen=True).start()
    try:
        under_one = _delivery(deployment, one_id, epochs[1])
    finally:
        reported.stop()
    print(
        f"ATTACK 1a 8 sockets claiming shuffler-1 (head + one chunk, reopened when answered): "
        f"shuffler-2's part stored after {under_one:.2f} s; {_cuts(reported)}; "
        f"honest control stored after {control:.2f} s"
    )
    # 1b: every registered id, shuffler-2 included, with a well-formed ESA-Preauth signed by
    # another key, trickling at 2x the minimum rate, reopened when answered.
    ids = [f"shuffler-{i}" for i in (2, 1, 3)]
    forged = _forged_preauth("shuffler-2")
    everyone = Holder(
        url=url, ids=ids, count=8, rate=int(2 * RATE), preauth=forged, reopen=True
    ).start()
    try:
        under_every = _delivery(deployment, every_id, epochs[2])
    finally:
        everyone.stop()
    print(
        f"ATTACK 1b 8 sockets claiming every shuffler id with an ESA-Preauth of another key at "
        f"{2 * RATE:g} B/s (reopened): shuffler-2's part stored after {under_every:.2f} s; "
        f"{_cuts(everyone)}; honest control stored after {control:.2f} s"
    )
    # 1e: shuffler-2's own id, with a head whose timestamp is an hour old (out of its window).
    stale_head = forged.split(".", 1)[1]
    own = Holder(
        url=url, ids=["shuffler-2"], count=8, preauth=f"{int(time.time()) - 3600}.{stale_head}",
        reopen=True,
    ).start()  # fmt: skip
    try:
        under_own = _delivery(deployment, own_id, epochs[3])
    finally:
        own.stop()
    print(
        f"ATTACK 1e 8 sockets claiming shuffler-2 itself with an hour-old ESA-Preauth (reopened):"
        f" shuffler-2's part stored after {under_own:.2f} s; {_cuts(own)}; honest control "
        f"stored after {control:.2f} s"
    )
    busy, cut = _counted(url, "busy") - busy_before, _counted(url, "requests_body_timeout")
    print(
        f"ATTACK 1 summary: honest parts answered busy {busy:g}, forged reads cut by the body "
        f"deadline {cut - cut_before:g}, refused bad_preauth {_counted(url, 'bad_preauth'):g}"
    )
    for holder in (reported, everyone, own):
        assert holder.answers and all(a == b"HTTP/1.1 401 Unauthorized" for a in holder.answers), (
            holder.answers
        )
    assert busy == 0  # no slot was ever taken from shuffler-2's forwarder
    assert cut == cut_before  # no forged read got a slot: none waited for the deadline


def _held(url: str, head: bytes) -> tuple[bytes, float]:
    """``head`` and 10 bytes of its declared 1,000-byte body, then nothing: the first line
    of the answer and how long the socket was held."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(head + b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
        started, answer = time.monotonic(), b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer.split(b"\r\n", 1)[0], time.monotonic() - started


def test_every_route_that_reads_a_body_cuts_a_held_one(deployment: Deployment) -> None:
    """The same deadlines on a shuffler's ``POST /v1/contributions`` (its direct route), its
    admin routes, and the analyzer's admin routes; half a head is cut too."""
    shuffler, analyzer = deployment.shufflers[0], deployment.analyzer
    token = httpx.post(shuffler.url + "/v1/enroll", timeout=10).json()["client_token"]
    admin = given_headers(shuffler.spec)["Authorization"].encode()
    heads = {
        "shuffler contributions": (
            shuffler.url,
            b"POST /v1/contributions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + token.encode()
            + b"\r\nContent-Type: application/octet-stream\r\n",
        ),
        "shuffler admin close": (
            shuffler.url,
            b"POST /v1/admin/close HTTP/1.1\r\nHost: x\r\nAuthorization: " + admin + b"\r\n",
        ),
        "analyzer admin channels": (
            analyzer.url,
            b"POST /v1/admin/channels HTTP/1.1\r\nHost: x\r\nAuthorization: "
            + given_headers(analyzer.spec)["Authorization"].encode()
            + b"\r\n",
        ),
    }
    for name, (url, head) in heads.items():
        line, held = _held(url, head)
        control = httpx.get(url + "/healthz", timeout=10).status_code
        print(
            f"ATTACK 1c {name} body held after 10 of 1000 bytes: {line.decode()} after "
            f"{held:.2f} s (minimum {RATE:g} B/s after {GRACE:g} s, deadline {BODY:g} s); honest "
            f"control GET /healthz meanwhile {control}"
        )
        # the rate cut it (about GRACE + a second), not the whole deadline
        assert line == b"HTTP/1.1 408 Request Timeout" and held < BODY, (name, held)
    where = urlsplit(shuffler.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/contributions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        started, answer = time.monotonic(), b""
        while chunk := sock.recv(65536):
            answer += chunk
        held = time.monotonic() - started
    line = answer.split(b"\r\n", 1)[0].decode()
    print(f"ATTACK 1d half a head to a shuffler: {line} after {held:.2f} s (deadline {HEAD:g} s)")
    assert answer.startswith(b"HTTP/1.1 408 ") and b"head_timeout" in answer
    assert held < HEAD + 5.0  # the head deadline, not never
