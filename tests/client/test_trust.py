"""Who vouches for what a device uses (docs/protocol.md, "Who vouches for what"): the analyzer's
signed config carries each shuffler's own signed descriptor, and a device pins one key per
trust domain (:class:`TrustAnchors`).

:func:`verify_collection` is tested on documents signed here with real Ed25519 keys; the SDK
(:class:`Client`) against configs served by a real HTTP server on 127.0.0.1 whose answers a
test changes: rollback through the device's state file, refresh when the config or a
descriptor expires, and nothing sent with keys nobody vouches for any more.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import (
    CONFIG,
    DESCRIPTOR_CONTEXT,
    CollectionConfigError,
    TrustAnchors,
    canonical,
    fingerprint,
    sign_config,
    verify_collection,
    verify_config,
)
from common.envelope import (
    EnvelopeError,
    FragmentContext,
    KeyRing,
    key_id,
    open_contribution,
    open_fragment,
    public_bytes,
)
from common.wire import (
    MAX_EPOCH_SECONDS,
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    HpkeKey,
    SignedDescriptor,
    b64,
)
from encoder_client import Client, ConfigError

from ..support import descriptor, offline_config

CHANNEL = ChannelConfig(
    id="pages",
    mechanism="krr",
    params={"k": 4, "eps": 2.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=20,
    max_fragments=1,
    payload_size=16,
)
#: Time in these tests: the documents are issued around it, the devices' clocks read it.
T0 = 1_900_000_000


@dataclass
class Parties:
    """The analyzer's and two shufflers' keys, as each party holds its own."""

    analyzer_signer: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    analyzer_hpke: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    signers: dict[str, Ed25519PrivateKey] = field(
        default_factory=lambda: {f"shuffler-{i}": Ed25519PrivateKey.generate() for i in (1, 2)}
    )
    hpke: dict[str, X25519PrivateKey] = field(
        default_factory=lambda: {f"shuffler-{i}": X25519PrivateKey.generate() for i in (1, 2)}
    )
    url: str = "http://127.0.0.1:9"

    def trust(self) -> TrustAnchors:
        """What a device pins: the analyzer's key and every shuffler's own."""
        return TrustAnchors(
            self.analyzer_signer.public_key(),
            {sid: key.public_key() for sid, key in self.signers.items()},
        )

    def descriptor(
        self, shuffler_id: str, issued: int = T0, lifetime: int = 10**6
    ) -> dict[str, Any]:
        """The shuffler's own signed descriptor, issued at ``issued``."""
        signed = descriptor(
            self.signers[shuffler_id], self.hpke[shuffler_id], shuffler_id, self.url
        )
        body = dict(signed.descriptor, issued_at=issued, expires_at=issued + lifetime)
        return _signed_descriptor(body, self.signers[shuffler_id])

    def config(
        self,
        issued: int = T0,
        lifetime: int = 10**6,
        shufflers: list[dict[str, Any]] | None = None,
        analyzer_hpke: X25519PrivateKey | None = None,
    ) -> dict[str, Any]:
        """The analyzer's signed config carrying the shufflers' descriptors as they signed
        them (by default both, issued at ``issued``)."""
        hpke = (analyzer_hpke or self.analyzer_hpke).public_key()
        info = AnalyzerInfo(
            url=self.url,
            keys=[HpkeKey(key_id=key_id(hpke).hex(), public_key=b64(public_bytes(hpke)))],
            signing_key=b64(public_bytes(self.analyzer_signer.public_key())),
        )
        listed = (
            shufflers
            if shufflers is not None
            else [self.descriptor(s, issued) for s in self.signers]
        )
        config = CollectionConfig(
            issued_at=issued,
            expires_at=issued + lifetime,
            analyzer=info,
            shufflers=[SignedDescriptor.model_validate(d) for d in listed],
            channels=[CHANNEL],
        )
        return sign_config(config, self.analyzer_signer).model_dump(mode="json")

    def resign(self, config: dict[str, Any]) -> dict[str, Any]:
        """What the analyzer can do alone: sign any config body with its own key."""
        return {
            "config": config,
            "signature": b64(self.analyzer_signer.sign(canonical(config))),
        }


def _signed_descriptor(body: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    return {"descriptor": body, "signature": b64(key.sign(DESCRIPTOR_CONTEXT + canonical(body)))}


# --- verify_collection ------------------------------------------------------------------------


def _by_document(versions: dict[str, int] | Any) -> dict[str, int]:
    """Issue times by document, without the pinned key's fingerprint."""
    return {name.rsplit("/", 1)[0]: issued for name, issued in versions.items()}


def test_an_honest_collection_verifies_with_each_partys_own_key() -> None:
    parties = Parties()
    verified = verify_collection(parties.config(), parties.trust(), T0 + 10)
    assert [s.id for s in verified.shufflers] == ["shuffler-1", "shuffler-2"]
    for shuffler in verified.shufflers:
        hpke = parties.hpke[shuffler.id].public_key()
        assert shuffler.public_key == b64(public_bytes(hpke))
        assert shuffler.key_id == key_id(hpke).hex()
        assert shuffler.signing_key == b64(public_bytes(parties.signers[shuffler.id].public_key()))
    assert _by_document(verified.versions) == {
        CONFIG: T0,
        "shuffler/shuffler-1": T0,
        "shuffler/shuffler-2": T0,
    }
    # each document's history is kept under the key pinned for it
    assert f"{CONFIG}/{fingerprint(parties.trust().analyzer)}" in verified.versions
    assert verified.channel("pages") == CHANNEL and verified.channel("nope") is None
    # the first expiry of all the documents is the collection's
    short = parties.descriptor("shuffler-2", lifetime=50)
    shorter = parties.config(shufflers=[parties.descriptor("shuffler-1"), short])
    assert verify_collection(shorter, parties.trust(), T0).expires_at == T0 + 50


def test_a_shuffler_key_the_analyzer_substitutes_is_refused() -> None:
    """The analyzer signs the config with its real key, but changed what shuffler-1's
    descriptor says (its HPKE key, then its URL): shuffler-1's signature no longer holds."""
    parties, own = Parties(), X25519PrivateKey.generate()
    for change in (
        {
            "keys": [
                {
                    "key_id": key_id(own.public_key()).hex(),
                    "public_key": b64(public_bytes(own.public_key())),
                }
            ]
        },
        {"url": "http://analyzer.example/collect"},
    ):
        body = parties.config()["config"]
        body["shufflers"][0]["descriptor"].update(change)
        forged = parties.resign(body)
        verify_config(forged, parties.trust().analyzer, T0)  # the analyzer's signature holds
        with pytest.raises(
            CollectionConfigError, match="'shuffler-1' is not signed by the key pinned"
        ):
            verify_collection(forged, parties.trust(), T0)


def test_a_descriptor_signed_by_anyone_but_the_pinned_key_is_refused() -> None:
    parties = Parties()
    # the analyzer makes up a shuffler-1 with keys of its own, signed by itself
    impostor = Parties()
    forged = parties.config(
        shufflers=[impostor.descriptor("shuffler-1"), parties.descriptor("shuffler-2")]
    )
    with pytest.raises(CollectionConfigError, match="not signed by the key pinned"):
        verify_collection(forged, parties.trust(), T0)
    # a shuffler signing a descriptor that names another signing key (not the one pinned)
    body = dict(parties.descriptor("shuffler-1")["descriptor"])
    body["signing_key"] = b64(public_bytes(Ed25519PrivateKey.generate().public_key()))
    renamed = _signed_descriptor(body, parties.signers["shuffler-1"])
    with pytest.raises(CollectionConfigError, match="names another signing key"):
        verify_collection(parties.config(shufflers=[renamed]), parties.trust(), T0)
    # the descriptor's signature covers its context: canonical bytes alone (as a batch body is
    # signed) do not make a descriptor
    plain = parties.descriptor("shuffler-1")
    plain["signature"] = b64(parties.signers["shuffler-1"].sign(canonical(plain["descriptor"])))
    with pytest.raises(CollectionConfigError, match="not signed by the key pinned"):
        verify_collection(parties.config(shufflers=[plain]), parties.trust(), T0)


def test_a_shuffler_the_device_does_not_pin_is_refused() -> None:
    parties = Parties()
    only_one = TrustAnchors(
        parties.trust().analyzer, {"shuffler-1": parties.trust().shufflers["shuffler-1"]}
    )
    with pytest.raises(
        CollectionConfigError, match="'shuffler-2', whose key this device does not pin"
    ):
        verify_collection(parties.config(), only_one, T0)
    # pinned under another id: the descriptor's own id decides which pin checks it
    swapped = TrustAnchors(
        parties.trust().analyzer,
        {
            "shuffler-1": parties.trust().shufflers["shuffler-2"],
            "shuffler-2": parties.trust().shufflers["shuffler-1"],
        },
    )
    with pytest.raises(CollectionConfigError, match="not signed by the key pinned"):
        verify_collection(parties.config(), swapped, T0)
    twice = parties.config(shufflers=[parties.descriptor("shuffler-1")] * 2)
    with pytest.raises(CollectionConfigError, match="twice"):
        verify_collection(twice, parties.trust(), T0)
    with pytest.raises(CollectionConfigError, match="no shuffler"):
        verify_collection(parties.config(shufflers=[]), parties.trust(), T0)


def test_expired_documents_are_refused() -> None:
    parties = Parties()
    config = parties.config(lifetime=100)
    verify_collection(config, parties.trust(), T0 + 100)
    with pytest.raises(CollectionConfigError, match=f"collection config expired at {T0 + 100}"):
        verify_collection(config, parties.trust(), T0 + 101)
    stale = parties.config(
        shufflers=[parties.descriptor("shuffler-1", lifetime=30), parties.descriptor("shuffler-2")]
    )
    verify_collection(stale, parties.trust(), T0 + 30)
    with pytest.raises(CollectionConfigError, match=f"'shuffler-1' expired at {T0 + 30}"):
        verify_collection(stale, parties.trust(), T0 + 31)


def test_documents_older_than_ones_seen_are_refused() -> None:
    parties = Parties()
    seen = verify_collection(parties.config(issued=T0 + 60), parties.trust(), T0 + 60).versions
    # the same documents again, or newer ones, are fine
    verify_collection(parties.config(issued=T0 + 60), parties.trust(), T0 + 60, seen)
    verify_collection(parties.config(issued=T0 + 61), parties.trust(), T0 + 61, seen)
    with pytest.raises(CollectionConfigError, match=f"collection config issued at {T0} is older"):
        verify_collection(parties.config(issued=T0), parties.trust(), T0 + 60, seen)
    # a new config replaying an old descriptor of one shuffler (its old HPKE key, say)
    old = parties.config(
        issued=T0 + 70,
        shufflers=[parties.descriptor("shuffler-1", T0), parties.descriptor("shuffler-2", T0 + 70)],
    )
    with pytest.raises(CollectionConfigError, match="descriptor of shuffler 'shuffler-1' issued"):
        verify_collection(old, parties.trust(), T0 + 70, seen)


def test_trust_anchors_round_trip_and_refuse_what_they_cannot_use(tmp_path: Path) -> None:
    trust = Parties().trust()
    path = tmp_path / "trust.json"
    path.write_text(json.dumps(trust.to_json()))
    loaded = TrustAnchors.load(path)
    assert loaded.to_json() == trust.to_json()
    assert sorted(loaded.shufflers) == ["shuffler-1", "shuffler-2"]
    for data, message in (
        ([], "must be"),
        ({"analyzer": trust.to_json()["analyzer"]}, "must be"),
        ({"analyzer": trust.to_json()["analyzer"], "shufflers": {}}, "pin no shuffler"),
        ({"analyzer": "AAAA", "shufflers": trust.to_json()["shufflers"]}, "analyzer key"),
        ({"analyzer": trust.to_json()["analyzer"], "shufflers": {"s": 1}}, "shuffler 's' key"),
    ):
        with pytest.raises(ValueError, match=message):
            TrustAnchors.from_json(data)
    with pytest.raises(ValueError, match="trust file"):
        TrustAnchors.load(tmp_path / "missing.json")


# --- the SDK --------------------------------------------------------------------------------


@dataclass
class Served:
    """A real HTTP server: ``GET /v1/config`` answers :attr:`config`; as a shuffler it enrols
    and takes contributions (202), keeping their bodies."""

    url: str
    config: dict[str, Any]
    config_gets: int = 0
    contributions: list[bytes] = field(default_factory=list)


@pytest.fixture
def served() -> Iterator[Served]:
    state = Served("", {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.config_gets += 1
            self._json(200, state.config)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path.endswith("/v1/enroll"):
                self._json(200, {"client_token": "device.token"})
            else:
                state.contributions.append(body)
                self._json(202, {"receipt": str(len(state.contributions))})

        def _json(self, status: int, answer: object) -> None:
            raw = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _trust_file(parties: Parties, tmp: Path) -> Path:
    path = tmp / "trust.json"
    path.write_text(json.dumps(parties.trust().to_json()))
    return path


def _one_shuffler(parties: Parties) -> Parties:
    """Both parties' documents name one shuffler, so every contribution goes to it."""
    parties.signers.pop("shuffler-2")
    parties.hpke.pop("shuffler-2")
    return parties


def _device(config: Path, trust: Path, state: Path, now: float) -> Client:
    """An offline device reading ``config``, pinning ``trust``, keeping ``state``, at ``now``."""
    return Client(
        config_file=config,
        trust_file=trust,
        state_path=state,
        background=False,
        clock=Clock(now),
    )


def test_the_sdk_refuses_an_older_config_than_its_state_file_accepted(tmp_path: Path) -> None:
    """Rollback through restarts: the issue times a device accepted live in its state file."""
    parties = Parties()
    trust, state = _trust_file(parties, tmp_path), tmp_path / "device.db"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(parties.config(issued=T0 + 100)))
    with _device(config, trust, state, T0 + 100) as c:
        # an older document offered to the running client: refused, the newer stays in use
        config.write_text(json.dumps(parties.config(issued=T0)))
        with pytest.raises(ConfigError, match="older than one this device accepted"):
            c.refresh_config()
        assert _by_document(c._config.versions)[CONFIG] == T0 + 100
    # after a restart: still refused, because the state file remembers
    with pytest.raises(ConfigError, match=f"issued at {T0} is older than one this device accepted"):
        _device(config, trust, state, T0 + 200)
    # a new config replaying one shuffler's old descriptor is refused the same way
    replaying = [parties.descriptor("shuffler-1", T0), parties.descriptor("shuffler-2", T0 + 300)]
    config.write_text(json.dumps(parties.config(issued=T0 + 300, shufflers=replaying)))
    with pytest.raises(ConfigError, match="descriptor of shuffler 'shuffler-1'"):
        _device(config, trust, state, T0 + 300)
    # the refusals came from the state: a device that never saw the newer one takes the old one
    config.write_text(json.dumps(parties.config(issued=T0)))
    with _device(config, trust, tmp_path / "other.db", T0 + 200):
        pass
    # and the first device still takes a newer one
    config.write_text(json.dumps(parties.config(issued=T0 + 400)))
    with _device(config, trust, state, T0 + 400) as c:
        assert _by_document(c._config.versions)[CONFIG] == T0 + 400


def _open(body: bytes, parties: Parties, analyzer: X25519PrivateKey, epoch: int) -> bytes:
    """The one fragment of a contribution, opened by the shuffler and then the analyzer."""
    contribution = open_contribution(body, "shuffler-1", KeyRing.of(parties.hpke["shuffler-1"]))
    (fragment,) = contribution.fragments
    return open_fragment(fragment, FragmentContext("pages", epoch, ""), KeyRing.of(analyzer))


def test_an_expired_config_is_fetched_again_before_a_report(served: Served, tmp_path: Path) -> None:
    """The config expires while the app runs: the next report fetches a fresh one and seals
    to the keys it names (here the analyzer rotated its HPKE key)."""
    parties = _one_shuffler(Parties(url=""))
    parties.url = served.url
    served.config = parties.config(issued=T0, lifetime=100)
    clock = Clock(T0 + 10)
    with Client(
        served.url + "/v1/config",
        trust_file=_trust_file(parties, tmp_path),
        state_path=tmp_path / "d.db",
        background=False,
        clock=clock,
    ) as client:
        assert served.config_gets == 1
        client.histogram("pages").report(1)
        assert served.config_gets == 1  # still valid: not fetched again
        assert client.flush() == 1
        rotated = X25519PrivateKey.generate()
        # past its expiry, in the next epoch
        clock.now = (T0 // MAX_EPOCH_SECONDS + 1) * MAX_EPOCH_SECONDS + 200
        served.config = parties.config(issued=int(clock.now) - 50, analyzer_hpke=rotated)
        client.histogram("pages").report(2)
        assert served.config_gets == 2
        assert _by_document(client._config.versions)[CONFIG] == int(clock.now) - 50
        assert client.flush() == 1
    assert len(served.contributions) == 2
    epoch = int(clock.now // MAX_EPOCH_SECONDS)
    assert _open(served.contributions[1], parties, rotated, epoch)  # sealed to the new key
    with pytest.raises(EnvelopeError, match="no live key"):
        _open(served.contributions[1], parties, parties.analyzer_hpke, epoch)


def test_an_expired_descriptor_is_refreshed_too(served: Served, tmp_path: Path) -> None:
    """The config is valid for long, but the shuffler's descriptor in it expires first: the
    device fetches again rather than keep sending to a key its shuffler no longer vouches for."""
    parties = _one_shuffler(Parties())
    parties.url = served.url
    short = parties.descriptor("shuffler-1", lifetime=100)
    served.config = parties.config(lifetime=10**6, shufflers=[short])
    clock = Clock(T0 + 10)
    with Client(
        served.url + "/v1/config",
        trust_file=_trust_file(parties, tmp_path),
        state_path=tmp_path / "d.db",
        background=False,
        clock=clock,
    ) as client:
        assert client._config.expires_at == T0 + 100
        served.config = parties.config(issued=T0 + 101, lifetime=10**6)
        clock.now = T0 + 101
        client.histogram("pages").report(0)
        assert served.config_gets == 2
        assert _by_document(client._config.versions)["shuffler/shuffler-1"] == T0 + 101


def test_an_expired_config_that_cannot_be_refreshed_sends_nothing(
    served: Served, tmp_path: Path
) -> None:
    """Expired, and every replacement offered is refused (the same expired one, an older one,
    a substituted shuffler): report raises ConfigError, flush sends nothing and keeps the
    outbox; once a valid config is served again, the queued contribution goes out."""
    parties = _one_shuffler(Parties())
    parties.url = served.url
    first = parties.config(issued=T0, lifetime=100)
    served.config = first
    clock = Clock(T0 + 10)
    with Client(
        served.url + "/v1/config",
        trust_file=_trust_file(parties, tmp_path),
        state_path=tmp_path / "d.db",
        background=False,
        clock=clock,
    ) as client:
        client.histogram("pages").report(3)  # queued, not flushed yet
        clock.now = T0 + 101
        forged = copy.deepcopy(parties.config(issued=T0 + 101, lifetime=10**6)["config"])
        impostor = X25519PrivateKey.generate()
        forged["shufflers"][0]["descriptor"]["keys"] = [
            {
                "key_id": key_id(impostor.public_key()).hex(),
                "public_key": b64(public_bytes(impostor.public_key())),
            }
        ]
        for offered in (
            first,
            parties.config(issued=T0 - 50, lifetime=10**6),
            parties.resign(forged),
        ):
            served.config = offered
            assert client.flush() == 0
            assert client.state.outbox_size() == 1
            with pytest.raises(ConfigError, match=f"expired at {T0 + 100}"):
                client.histogram("pages").report(1)
        assert served.contributions == []  # nothing reached the shuffler
        served.config = parties.config(issued=T0 + 101, lifetime=10**6)
        assert client.flush() == 1
    assert len(served.contributions) == 1
    epoch = int((T0 + 10) // MAX_EPOCH_SECONDS)
    assert _open(served.contributions[0], parties, parties.analyzer_hpke, epoch)


def test_offline_config_pins_both_keys(tmp_path: Path) -> None:
    """tests/support's offline config comes with its trust file, and only that trust opens it."""
    offline = offline_config(tmp_path, [CHANNEL])
    with Client(
        config_file=offline.path,
        trust_file=offline.trust_file,
        state_path=tmp_path / "a.db",
        background=False,
    ):
        pass
    with pytest.raises(ConfigError, match="not signed by the key pinned"):
        Client(
            config_file=offline.path,
            trusted_key=offline.trusted_key,
            shuffler_keys={
                "shuffler-1": b64(public_bytes(Ed25519PrivateKey.generate().public_key()))
            },
            state_path=tmp_path / "b.db",
            background=False,
        )
    with Client(
        config_file=offline.path,
        trusted_key=offline.trusted_key,
        shuffler_keys=offline.shuffler_keys,
        state_path=tmp_path / "c.db",
        background=False,
    ):
        pass


def test_a_document_issued_in_the_future_cannot_lock_a_device_out(tmp_path: Path) -> None:
    """An issuer whose clock stepped a year ahead signs one config; the device takes it, but
    remembers no later issue time than its own clock allows, so the honest configs issued
    after it (at the right time) are still taken."""
    parties = Parties()
    trust, state = _trust_file(parties, tmp_path), tmp_path / "device.db"
    config = tmp_path / "config.json"
    year = 365 * 24 * 3600
    config.write_text(json.dumps(parties.config(issued=T0 + year, lifetime=2 * year)))
    clock = Clock(T0 + 10)
    with Client(
        config_file=config, trust_file=trust, state_path=state, background=False, clock=clock
    ) as client:
        clock.now = T0 + 400
        config.write_text(json.dumps(parties.config(issued=T0 + 400)))
        client.refresh_config()
        assert _by_document(client._config.versions)[CONFIG] == T0 + 400
