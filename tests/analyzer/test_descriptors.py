"""The analyzer passes on each shuffler's own signed descriptor and never states a shuffler key
itself (analyzer/descriptors.py; docs/protocol.md, "Who vouches for what")."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.descriptors import ShufflerDescriptors
from analyzer.errors import ShufflersUnavailableError
from analyzer.service import MIGRATIONS
from analyzer.store import AnalyzerStore
from common.collection import (
    CollectionConfigError,
    TrustAnchors,
    sign_descriptor,
    verify_collection,
)
from common.envelope import load_or_create_ed25519
from common.wire import ShufflerDescriptor, ShufflerEntry
from runtime import db

from ..support import (
    SMALL_CHANNEL,
    analyzer_process,
    descriptor,
    registry_entry,
    shuffler_process,
    wait_until,
)
from .helpers import CHANNEL


def _entry(signer: Ed25519PrivateKey, url: str = "http://127.0.0.1:9") -> ShufflerEntry:
    return ShufflerEntry.model_validate(registry_entry("shuffler-1", url, signer))


def _store(url: str = "sqlite://") -> AnalyzerStore:
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    return AnalyzerStore(engine)


def test_only_a_descriptor_signed_with_the_pinned_key_is_kept() -> None:
    signer, hpke = Ed25519PrivateKey.generate(), X25519PrivateKey.generate()
    held = ShufflerDescriptors([_entry(signer)], _store())
    with pytest.raises(ShufflersUnavailableError, match="shuffler-1"):
        held.current()
    with pytest.raises(CollectionConfigError, match="not signed by the key pinned"):
        held.offer(descriptor(Ed25519PrivateKey.generate(), hpke))
    with pytest.raises(CollectionConfigError, match="unregistered shuffler"):
        held.offer(descriptor(signer, hpke, "shuffler-9"))
    assert held.missing() == ["shuffler-1"]
    first = descriptor(signer, hpke)
    assert held.offer(first)
    assert held.current() == [first]


def test_a_newer_descriptor_replaces_an_older_one_never_the_reverse(database_url: str) -> None:
    """Two analyzer workers on one database serve the same, newest descriptor."""
    signer = Ed25519PrivateKey.generate()
    store = _store(database_url)
    held, other = (
        ShufflerDescriptors([_entry(signer)], store),
        ShufflerDescriptors([_entry(signer)], AnalyzerStore(db.make_engine(database_url))),
    )
    old = descriptor(signer, X25519PrivateKey.generate())
    time.sleep(1.05)
    new = descriptor(signer, X25519PrivateKey.generate())
    assert held.offer(new)
    assert not other.offer(old)
    assert held.current() == other.current() == [new]


def test_an_expired_descriptor_is_missing() -> None:
    signer = Ed25519PrivateKey.generate()
    now = [time.time()]
    held = ShufflerDescriptors([_entry(signer)], _store(), clock=lambda: now[0])
    held.offer(descriptor(signer, X25519PrivateKey.generate(), lifetime=60))
    assert held.missing() == []
    now[0] += 120
    assert held.missing() == ["shuffler-1"]
    with pytest.raises(ShufflersUnavailableError):
        held.current()


@pytest.mark.system
def test_the_config_waits_for_the_shuffler_and_carries_its_own_descriptor(tmp_path: Path) -> None:
    """A real analyzer and a real shuffler: ``GET /v1/config`` answers 503 until the shuffler
    is up, then carries the descriptor exactly as the shuffler signs it."""
    shuffler = shuffler_process(tmp_path, "shuffler-1", [SMALL_CHANNEL])  # not started yet
    url = shuffler.url
    signer = load_or_create_ed25519(tmp_path / "shuffler-1" / "keys" / "signing.pem")
    channel = CHANNEL.model_dump(mode="json")
    analyzer = analyzer_process(tmp_path, [channel], [registry_entry("shuffler-1", url, signer)])
    analyzer.start()
    try:
        waiting = httpx.get(analyzer.url + "/v1/config", timeout=10)
        assert waiting.status_code == 503
        assert waiting.json()["error"] == "shufflers_unavailable"
        shuffler.start()
        try:
            wait_until(lambda: httpx.get(analyzer.url + "/v1/config").status_code == 200, 30)
            document = httpx.get(analyzer.url + "/v1/config").json()
            served = httpx.get(url + "/v1/descriptor").json()
            assert (
                document["config"]["shufflers"][0]["descriptor"]["keys"]
                == (served["descriptor"]["keys"])
            )
            trust = TrustAnchors.load(_trust(tmp_path, signer))
            config = verify_collection(document, trust, time.time())
            assert [s.url for s in config.shufflers] == [url]
        finally:
            shuffler.stop()
    finally:
        analyzer.stop()


def _trust(tmp: Path, signer: Ed25519PrivateKey) -> Path:
    """A trust file pinning the analyzer's config key and the shuffler's key."""
    analyzer_key = load_or_create_ed25519(tmp / "analyzer" / "keys" / "signing.pem")
    path = tmp / "trust.json"
    trust = TrustAnchors(analyzer_key.public_key(), {"shuffler-1": signer.public_key()})
    path.write_text(json.dumps(trust.to_json()))
    return path


def test_a_future_dated_or_formerly_pinned_descriptor_does_not_block_a_fresh_one() -> None:
    """Only a newer descriptor replaces a kept one; one issued a year ahead (a clock step) or
    signed by a key the analyzer no longer pins would otherwise be kept, and served, for good."""
    old_signer, signer = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    store = _store()
    ahead = descriptor(old_signer, X25519PrivateKey.generate(), lifetime=10**9)
    ahead_doc = ahead.model_copy(
        update={"descriptor": {**ahead.descriptor, "issued_at": int(time.time()) + 10**8}}
    )
    before = ShufflerDescriptors([_entry(old_signer)], store)
    signed = sign_descriptor(ShufflerDescriptor.model_validate(ahead_doc.descriptor), old_signer)
    assert before.offer(signed)
    assert before.missing() == ["shuffler-1"]  # issued in the future: not served
    fresh = descriptor(old_signer, X25519PrivateKey.generate())
    assert before.offer(fresh) and before.current() == [fresh]
    repinned = ShufflerDescriptors([_entry(signer)], store)  # the analyzer pins a new key
    assert repinned.missing() == ["shuffler-1"]  # the kept one no longer verifies
    newer = descriptor(signer, X25519PrivateKey.generate())
    assert repinned.offer(newer) and repinned.current() == [newer]
