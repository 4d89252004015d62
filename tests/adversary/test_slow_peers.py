"""Attack 5 (a shuffler answers the analyzer's descriptor fetch one byte every 3 s): each fetch
ends at its whole-request deadline, and each shuffler is fetched by a thread of its own, so the
honest shuffler's descriptor stays as fresh as without the slow one (analyzer/descriptors.py,
common/fetching.py; docs/operations.md, "Fetch deadlines")."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.store import AnalyzerStore
from common.envelope import load_or_create_ed25519
from runtime import db

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

#: The attack's pace: one byte every GAP seconds (each read well within any per-read timeout).
GAP = 3.0
#: The analyzer's whole-request deadline of a descriptor fetch (its default).
DEADLINE = 5.0


class _SlowShuffler(QuietHandler):
    """Shuffler 2: serves its valid signed descriptor at once while ``slow`` is unset, then
    one byte every :data:`GAP` seconds; records how long each slow answer was held open."""

    document: ClassVar[bytes] = b""
    slow: ClassVar[threading.Event] = threading.Event()
    held: ClassVar[list[float]] = []

    def do_GET(self) -> None:
        if not self.slow.is_set():
            self.dribble(200, self.document, 0.0)
            return
        type(self).held.append(self.dribble(200, self.document, GAP))


def _honest_age(store: AnalyzerStore, seconds: float) -> float:
    """The oldest the honest shuffler's kept descriptor got (now - issued_at) over ``seconds``."""
    oldest, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        document = json.loads(store.descriptors()["shuffler-1"][1])
        oldest = max(oldest, time.time() - document["descriptor"]["issued_at"])
        time.sleep(0.2)
    return oldest


def test_a_slow_descriptor_server_holds_no_fetch_past_its_deadline(tmp_path: Path) -> None:
    slow_signer = Ed25519PrivateKey.generate()
    with handler_served(_SlowShuffler) as slow_url:
        document = descriptor(slow_signer, X25519PrivateKey.generate(), "shuffler-2", slow_url)
        _SlowShuffler.document = document.model_dump_json().encode()
        shuffler = shuffler_process(tmp_path, "shuffler-1", [SMALL_CHANNEL]).start()
        signer = load_or_create_ed25519(tmp_path / "shuffler-1" / "keys" / "signing.pem")
        registry = [  # the slow one first: fetched one after another, it would go first
            registry_entry("shuffler-2", slow_url, slow_signer),
            registry_entry("shuffler-1", shuffler.url, signer),
        ]
        analyzer = analyzer_process(
            tmp_path,
            [CHANNEL.model_dump(mode="json")],
            registry,
            descriptor_refresh_seconds="1",
        ).start()
        store = AnalyzerStore(db.make_engine(f"sqlite:///{tmp_path / 'analyzer' / 'db.sqlite'}"))
        try:
            wait_until(lambda: {"shuffler-1", "shuffler-2"} <= set(store.descriptors()), 30)
            control = _honest_age(store, 6.0)
            _SlowShuffler.slow.set()
            attacked = _honest_age(store, 20.0)
            wait_until(lambda: _SlowShuffler.held, 15)
        finally:
            analyzer.stop()
            shuffler.stop()
            store.engine.dispose()
        held = max(_SlowShuffler.held)
        print(
            f"ATTACK 5 descriptor one byte every {GAP:g} s: fetch held {held:.1f} s "
            f"(deadline {DEADLINE:g} s, whole answer {len(_SlowShuffler.document) * GAP:.0f} s); "
            f"honest shuffler's descriptor age max {attacked:.1f} s over 20 s; "
            f"honest control (no slow server) age max {control:.1f} s"
        )
        assert held < DEADLINE + 1.0
        assert attacked < control + 1.5  # no refresh late (fetched one after another: +5 s)
