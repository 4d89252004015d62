"""``POST /v1/batches`` reads parts before their signature is checked in slots partitioned by
the ``ESA-Shuffler`` id a request claims (analyzer/slots.py), taken only by a request whose
``ESA-Preauth`` head that shuffler signed (common/preauth.py); the server's body deadline
(runtime/deadlines.py) bounds how long a read holds one. The analyzer app under the services'
real server, real sockets, real signatures."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from analyzer.app import create_app
from analyzer.errors import IntakeBusyError
from analyzer.settings import AnalyzerSettings
from analyzer.slots import IntakeSlots
from common.preauth import preauth_header
from common.wire import b64

from ..support import served, wait_until
from .helpers import SHUFFLERS, VALUES, app_settings, counter, make_batch, post

#: The body deadline of the app under test (seconds): long enough that a post made right after
#: the held read took its slot finds it still taken on a loaded machine.
BODY_DEADLINE = 10.0


def test_each_sender_has_its_own_slots() -> None:
    slots = IntakeSlots(2)
    with slots.slot("shuffler-1"), slots.slot("shuffler-1"):
        with pytest.raises(IntakeBusyError, match="shuffler-1") as busy, slots.slot("shuffler-1"):
            pass
        assert busy.value.retry_after == 1.0
        with slots.slot("shuffler-2"), slots.slot("shuffler-2"):
            assert (slots.held("shuffler-1"), slots.held("shuffler-2")) == (2, 2)
    with pytest.raises(RuntimeError), slots.slot("shuffler-1"):
        raise RuntimeError("a read that failed")
    assert (slots.held("shuffler-1"), slots.held("shuffler-2")) == (0, 0)
    with pytest.raises(ValueError, match="got 0"):
        IntakeSlots(0)


def _settings(tmp_path: Path, **update: object) -> AnalyzerSettings:
    """The test app's settings with ``update``, validated again (``model_copy`` would skip
    the validators, such as the rate grace being below the body deadline)."""
    return AnalyzerSettings(**{**app_settings(tmp_path).model_dump(), **update})


def _hold(url: str, shuffler: str, preauth: str | None) -> socket.socket:
    """A request claiming ``shuffler`` (with ``preauth`` as its ``ESA-Preauth``, if any): a
    head and one chunk of a chunked body, then nothing (the socket is returned open)."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), 10)
    head = b"" if preauth is None else b"\r\nESA-Preauth: " + preauth.encode()
    sock.sendall(
        b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nESA-Shuffler: " + shuffler.encode()
        + b"\r\nESA-Signature: " + b64(os.urandom(64)).encode() + head
        + b"\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n" + b"x" * 16 + b"\r\n"
    )  # fmt: skip
    return sock


def _answer(sock: socket.socket) -> bytes:
    """What the server answers before it closes ``sock`` (or its head, once here)."""
    sock.settimeout(60)
    answer = b""
    while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
        answer += chunk
    return answer


@pytest.mark.slow
def test_a_sender_without_the_shufflers_head_never_takes_a_slot(tmp_path: Path) -> None:
    """Eight requests claiming shuffler-1, without ``ESA-Preauth`` or with one signed by
    another key, are refused 401 ``bad_preauth`` from the head alone: none of them ever holds
    shuffler-1's one slot, and shuffler-1's own part is stored."""
    app = create_app(_settings(tmp_path, intake_slots_per_shuffler=1))
    slots: IntakeSlots = app.state.intake_slots
    other_key = Ed25519PrivateKey.generate()
    with served(app) as port:
        url = f"http://127.0.0.1:{port}"
        forged = [
            _hold(url, "shuffler-1", None if i % 2 else preauth_header(
                "shuffler-1", os.urandom(1024), other_key, time.time()))
            for i in range(8)
        ]  # fmt: skip
        answers = [_answer(sock) for sock in forged]
        held_meanwhile = slots.held("shuffler-1")
        honest = post(url, make_batch(VALUES, shuffler="shuffler-1"))
        for sock in forged:
            sock.close()
        refused = _rejected(url, "bad_preauth"), _rejected(url, "busy")
    print(
        f"8 forgers on shuffler-1: {sorted({a.split(b' ')[1] for a in answers})} "
        f"(slots held meanwhile {held_meanwhile}); shuffler-1's part {honest.status_code}"
    )
    assert all(a.startswith(b"HTTP/1.1 401 ") and b'"bad_preauth"' in a for a in answers)
    assert held_meanwhile == 0 and honest.status_code == 201
    assert refused == (8, 0)


@pytest.mark.slow
def test_a_held_read_keeps_its_slot_only_until_the_body_deadline(tmp_path: Path) -> None:
    """A read the shuffler's head vouches for (a head replayed within its window, or the
    shuffler's own stalled send) whose body never comes holds that shuffler's one slot, not
    another's, and only until the body deadline: 408 ``body_timeout``, and the slot is free."""
    app = create_app(
        _settings(
            tmp_path,
            intake_slots_per_shuffler=1,
            body_timeout_seconds=BODY_DEADLINE,
            body_min_rate_bytes=0.0,
        )
    )
    slots: IntakeSlots = app.state.intake_slots
    bodies = [make_batch(VALUES, shuffler=name) for name in ("shuffler-2", "shuffler-1")]
    head = preauth_header("shuffler-1", b"y" * 1024, SHUFFLERS["shuffler-1"], time.time())
    with served(app) as port:
        url = f"http://127.0.0.1:{port}"
        holder = _hold(url, "shuffler-1", head)
        started = time.monotonic()
        wait_until(lambda: slots.held("shuffler-1") == 1)  # it holds shuffler-1's one slot
        other, claimed = (post(url, body) for body in bodies)
        cut = _answer(holder)
        held = time.monotonic() - started
        holder.close()
        after = post(url, make_batch(VALUES, shuffler="shuffler-1"))
        timeouts = counter(url, "requests_body_timeout")
        refused = _rejected(url, "busy"), _rejected(url, "incomplete_body")
    print(
        f"held read on shuffler-1: shuffler-2 {other.status_code}, shuffler-1 "
        f"{claimed.status_code} {claimed.json().get('error')}, held read cut after {held:.2f} s: "
        f"{cut.split(b' ')[1]!r}, then shuffler-1 {after.status_code}"
    )
    assert other.status_code == 201  # another id's slot was free
    assert (claimed.status_code, claimed.json().get("error")) == (503, "busy"), claimed.text
    assert cut.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in cut
    assert held >= BODY_DEADLINE - 0.5  # cut by the deadline, not before
    assert after.status_code == 201  # the slot was let go at the deadline
    assert timeouts == 1 and refused == (1, 1)  # the cut read is refused, never stored


def _rejected(url: str, reason: str) -> float:
    """``esa_analyzer_batches_rejected{reason}`` of a running analyzer (0 if absent)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'esa_analyzer_batches_rejected_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_the_test_settings_are_validated(tmp_path: Path) -> None:
    """The helper above validates what it changes (``model_copy`` did not): a grace not below
    the body deadline is refused."""
    with pytest.raises(ValueError, match="body_rate_grace_seconds"):
        _settings(tmp_path, body_timeout_seconds=3.0)
