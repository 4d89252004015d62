"""Anyone on the network against the analyzer's ``POST /v1/batches``: the sender is named in a
header, and its signed head (``ESA-Preauth``) checked before any of the body is read, its
signature before the body is parsed; no more than the largest legal part
(:func:`analyzer.settings.largest_part_bytes`, 4.95 MB for these channels) is ever read before
that, so an unauthenticated request costs the analyzer less than 10 MB whatever it sends.

Before, the analyzer buffered up to 512 MiB of any request and parsed its JSON to find who
claimed to send it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from analyzer.settings import largest_part_bytes
from common.preauth import PREAUTH_HEADER, preauth_header
from common.wire import b64

from ..support import Deployment, analyzer_process, registry_entry, wait_until
from .conftest import HOMEPAGE, PAGES

MB = 1024 * 1024
#: A well-formed signature that verifies nothing.
FORGED = b64(os.urandom(64))


def _rss(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def _post_stream(url: str, headers: dict[str, str], total: int) -> tuple[int, dict[str, str], int]:
    """POST ``total`` bytes of junk, chunked, until the server answers or stops reading;
    returns the status, the JSON error and how many body bytes were sent."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=30)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(
        f"POST /v1/batches HTTP/1.1\r\nHost: x\r\n{head}Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    sent, chunk = [0], os.urandom(MB)

    def pump() -> None:
        try:
            while sent[0] < total:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent[0] += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed: it stopped reading
            pass

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
        data = sock.recv(65536)
        if not data:
            break
        answer += data
    sock.close()
    pumping.join(timeout=30)
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1]), sent[0]


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.fixture
def analyzer_pid(deployment: Deployment) -> int:
    assert deployment.analyzer.service is not None
    return deployment.analyzer.service.process.pid


def test_a_200_mb_unauthenticated_post_costs_the_analyzer_under_10_mb(
    deployment: Deployment, analyzer_pid: int
) -> None:
    cap = largest_part_bytes([PAGES, HOMEPAGE])
    before = _rss(analyzer_pid, "VmRSS")
    Path(f"/proc/{analyzer_pid}/clear_refs").write_text("5")  # the peak starts again from now
    headers = {"ESA-Shuffler": "shuffler-1", "ESA-Signature": FORGED}
    status, error, sent = _post_stream(deployment.analyzer.url, headers, 200 * MB)
    growth = _rss(analyzer_pid, "VmHWM") - before
    print(
        f"200 MB chunked POST: {status} {error['error']} after {sent / MB:.0f} MB sent; analyzer "
        f"RSS {before / MB:.1f} MB, peak growth {growth / MB:.2f} MB (cap {cap / MB:.2f} MB)"
    )
    assert (status, error["error"]) == (401, "bad_preauth")  # refused from its head
    assert growth < 10 * MB
    assert sent < 100 * MB  # refused early, not after the whole body


def test_a_declared_200_mb_body_is_refused_before_it_is_read(deployment: Deployment) -> None:
    where = urlsplit(deployment.analyzer.url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nESA-Shuffler: shuffler-1\r\n"
            + f"ESA-Signature: {FORGED}\r\nContent-Length: {200 * MB}\r\n\r\n".encode()
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"ESA-Signature": FORGED}, "unknown_shuffler"),
        ({"ESA-Shuffler": "mallory", "ESA-Signature": FORGED}, "unknown_shuffler"),
        ({"ESA-Shuffler": "shuffler-1"}, "bad_signature"),
    ],
)
def test_an_unknown_sender_is_refused_before_its_body_is_read(
    deployment: Deployment, headers: dict[str, str], code: str
) -> None:
    status, error, sent = _post_stream(deployment.analyzer.url, headers, 50 * MB)
    assert (status, error["error"]) == (401, code)
    assert sent < 50 * MB


def test_a_body_is_verified_before_it_is_parsed(deployment: Deployment) -> None:
    """Junk that is not JSON, with a forged signature: 401 (not 400), so nothing was parsed;
    without the shuffler's head it is not even read (``bad_preauth``), and with a head signed
    by another key neither."""
    headers = {"ESA-Shuffler": "shuffler-1", "ESA-Signature": FORGED}
    status, error, _ = _post_stream(deployment.analyzer.url, headers, 2 * MB)
    assert (status, error["error"]) == (401, "bad_preauth")
    other = preauth_header("shuffler-1", b"{}", Ed25519PrivateKey.generate(), time.time())
    status, error, _ = _post_stream(deployment.analyzer.url, {**headers, PREAUTH_HEADER: other}, MB)
    assert (status, error["error"]) == (401, "bad_preauth")


def test_only_the_shufflers_own_head_takes_an_intake_slot(tmp_path: Path) -> None:
    """Each read before the signature may buffer the largest legal part: only a request whose
    ``ESA-Preauth`` the shuffler signed takes one of its intake slots, beyond them a request is
    refused at once (503 busy, Retry-After), and a forged one never gets that far (401
    ``bad_preauth``), so forged parts hold no body at all."""
    signer = Ed25519PrivateKey.generate()
    analyzer = analyzer_process(
        tmp_path,
        [PAGES.model_dump(mode="json")],
        [registry_entry("shuffler-1", "http://127.0.0.1:9", signer)],
        INTAKE_SLOTS_PER_SHUFFLER="1",
    )
    analyzer.start()
    try:
        where = urlsplit(analyzer.url)
        genuine = preauth_header("shuffler-1", b"x" * MB, signer, time.time())
        head = (
            "POST /v1/batches HTTP/1.1\r\nHost: x\r\nESA-Shuffler: shuffler-1\r\n"
            f"ESA-Signature: {FORGED}\r\n{PREAUTH_HEADER}: {genuine}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
        with socket.create_connection((where.hostname, where.port), timeout=10) as slow:
            slow.sendall(head + b"10\r\n" + b"x" * 16 + b"\r\n")  # holds the one slot
            sender = {"ESA-Shuffler": "shuffler-1", "ESA-Signature": FORGED}
            forged = _post_stream(analyzer.url, sender, MB)
            wait_until(lambda: _post_stream(analyzer.url, {**sender, PREAUTH_HEADER: genuine},
                                            MB)[1]["error"] == "busy")  # fmt: skip
        print(f"one slot held by a genuine head; a forged one: {forged[0]} {forged[1]['error']}")
        assert (forged[0], forged[1]["error"]) == (401, "bad_preauth")
    finally:
        analyzer.stop()
