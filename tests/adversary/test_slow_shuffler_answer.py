"""Attack 6 (a malicious shuffler takes a device's contribution and dribbles its 202, one
byte a second, each read well within httpx's per-read timeout): the device's POST ends at
its whole-request deadline (common.fetching.post_within) and each shuffler is sent to in a
thread of its own, so the device's contribution to the honest shuffler is delivered as soon as
without the slow one (encoder_client/_client.py, Client.flush; docs/sdk.md)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.envelope import load_or_create_ed25519, public_bytes
from common.wire import b64
from encoder_client import Client

from ..analyzer.helpers import CHANNEL
from ..support import (
    SMALL_CHANNEL,
    QuietHandler,
    analyzer_process,
    descriptor,
    handler_served,
    registry_entry,
    shuffler_process,
    wait_until,
)

pytestmark = [pytest.mark.system, pytest.mark.slow]

#: The attack's pace: one byte of the 202's body every GAP seconds.
GAP = 1.0
#: The 202's body (30 bytes: 30 s dribbled whole).
ANSWER = b'{"status": "accepted", "x": 1}'
#: The device's timeout: each read, and now each whole POST.
TIMEOUT = 3.0
#: The second channel, so one device has a report queued for each shuffler.
OTHER = CHANNEL.model_copy(update={"id": "pageviews"})


class _DribblingShuffler(QuietHandler):
    """Shuffler 2: serves its valid signed descriptor and enrols at once; answers a
    contribution 202 with its body one byte every :data:`GAP` seconds; records how long each
    such answer was held open."""

    document: ClassVar[bytes] = b""
    held: ClassVar[list[float]] = []

    def do_GET(self) -> None:
        self._answer(200, self.document)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.endswith("/v1/enroll"):
            self._answer(200, json.dumps({"client_token": "slow.token"}).encode())
            return
        type(self).held.append(self.dribble(202, ANSWER, GAP))

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _device(url: str, state: Path, shuffler_id: str, keys: dict[str, str]) -> Client:
    """A device pinning both shufflers' ``keys``, sending every report to ``shuffler_id``."""
    return Client(
        url,
        trusted_key=(state.parent / "analyzer.pub").read_text().strip(),
        shuffler_keys=keys,
        state_path=state,
        background=False,
        timeout=TIMEOUT,
        weights={shuffler_id: 1.0},
    )


def _pin(signer: Ed25519PrivateKey) -> str:
    return b64(public_bytes(signer.public_key()))


def _honest_delivery(client: Client) -> tuple[float, float]:
    """Flush ``client`` in a thread: seconds until its outbox holds the slow shuffler's item
    alone (the honest one delivered), and until the flush returned."""
    start, done = time.monotonic(), threading.Event()

    def flush() -> None:
        client.flush()
        done.set()

    flushing = threading.Thread(target=flush, daemon=True)
    flushing.start()
    wait_until(lambda: all(i.shuffler_id == "shuffler-2" for i in client.state.due(1e18)), 60)
    honest = time.monotonic() - start
    flushing.join(60)
    assert done.is_set()
    return honest, time.monotonic() - start


def test_a_shuffler_dribbling_its_answer_delays_no_delivery_to_another(tmp_path: Path) -> None:
    slow_signer = Ed25519PrivateKey.generate()
    with handler_served(_DribblingShuffler) as slow_url:
        document = descriptor(slow_signer, X25519PrivateKey.generate(), "shuffler-2", slow_url)
        _DribblingShuffler.document = document.model_dump_json().encode()
        policies = [SMALL_CHANNEL, {**SMALL_CHANNEL, "id": OTHER.id}]
        shuffler = shuffler_process(tmp_path, "shuffler-1", policies).start()
        signer = load_or_create_ed25519(tmp_path / "shuffler-1" / "keys" / "signing.pem")
        registry = [
            registry_entry("shuffler-1", shuffler.url, signer),
            registry_entry("shuffler-2", slow_url, slow_signer),
        ]
        channels = [CHANNEL.model_dump(mode="json"), OTHER.model_dump(mode="json")]
        analyzer = analyzer_process(tmp_path, channels, registry, publish_dir=str(tmp_path))
        analyzer.start()
        url = analyzer.url + "/v1/config"
        keys = {"shuffler-1": _pin(signer), "shuffler-2": _pin(slow_signer)}
        try:
            wait_until(lambda: (tmp_path / "analyzer.pub").exists(), 30)
            wait_until(lambda: len(httpx.get(url, timeout=5).json()["config"]["shufflers"]) == 2)
            with _device(url, tmp_path / "control.db", "shuffler-1", keys) as control:
                control.histogram(CHANNEL.id).report(3)
                control_honest, _ = _honest_delivery(control)
            state = tmp_path / "device.db"
            with _device(url, state, "shuffler-2", keys) as device:  # queued first: sent first
                device.histogram(CHANNEL.id).report(3)
            with _device(url, state, "shuffler-1", keys) as device:
                device.histogram(OTHER.id).report(5)
                assert device.state.outbox_size() == 2
                honest, flushed = _honest_delivery(device)
        finally:
            analyzer.stop()
            shuffler.stop()
        held = max(_DribblingShuffler.held)
        print(
            f"ATTACK 6 shuffler dribbling its 202 one byte every {GAP:g} s: device's POST held "
            f"{held:.1f} s (timeout {TIMEOUT:g} s, whole answer {len(ANSWER) * GAP:.0f} s); "
            f"honest shuffler's contribution delivered after {honest:.2f} s, flush returned "
            f"after {flushed:.1f} s; honest control (no slow shuffler) delivered after "
            f"{control_honest:.2f} s"
        )
        assert held < TIMEOUT + 1.5
        assert honest < control_honest + 1.5  # sent one after another: after the deadline
