"""A shuffler vouches for itself (docs/protocol.md, "Shuffler descriptor"): ``GET /v1/descriptor``
serves its id, the URL devices send to, its live HPKE keys (the current one first) and its
signing key, valid for ``descriptor_ttl_seconds``, signed with its own Ed25519 key over
``DESCRIPTOR_CONTEXT + canonical(descriptor)``. Checked over real HTTP against a uvicorn process
with the keys read from its own key files (what ``esa up`` pins in ``trust.json``), and on the
service with a second live HPKE key."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import (
    DESCRIPTOR_CONTEXT,
    CollectionConfigError,
    canonical,
    verify_descriptor,
)
from common.envelope import (
    Contribution,
    KeyRing,
    key_id,
    load_or_create_ed25519,
    load_or_create_x25519,
    load_x25519_public,
    new_nonce,
    public_bytes,
    seal_contribution,
)
from common.wire import ShufflerDescriptor, SignedDescriptor, b64
from runtime import db
from shuffler.app import MIGRATIONS
from shuffler.service import ShufflerService
from shuffler.settings import ShufflerSettings
from shuffler.store_backends import make_store

from ..support import SMALL_CHANNEL, ServiceProcess, shuffler_process
from .factory import POLICY, Clock

#: Where devices reach this shuffler: a public name in front of it, not its bind address.
PUBLIC_URL = "https://shuffler-1.example.org"
TTL = 600


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("descriptor")


@pytest.fixture(scope="module")
def service(keys: Path) -> Iterator[ServiceProcess]:
    process = shuffler_process(
        keys,
        "shuffler-1",
        [SMALL_CHANNEL],
        public_url=PUBLIC_URL + "/",  # a trailing slash is not part of the URL devices get
        descriptor_ttl_seconds=str(TTL),
    )
    yield process.start()
    process.stop()


def _fetch(service: ServiceProcess) -> SignedDescriptor:
    response = httpx.get(service.url + "/v1/descriptor", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return SignedDescriptor.model_validate(response.json())


@pytest.mark.system
def test_the_descriptor_is_signed_by_the_shuffler_and_names_its_url_and_key(
    service: ServiceProcess, keys: Path
) -> None:
    own = keys / "shuffler-1" / "keys"
    signer = load_or_create_ed25519(own / "signing.pem").public_key()  # what trust.json pins
    hpke = load_or_create_x25519(own / "hpke.pem").public_key()
    before = int(time.time())
    document = _fetch(service)
    after = int(time.time())
    # The signature, checked with the pinned key over the exact context and canonical bytes.
    signer.verify(
        base64.b64decode(document.signature), DESCRIPTOR_CONTEXT + canonical(document.descriptor)
    )
    descriptor = verify_descriptor(document, signer, time.time())
    assert descriptor.id == "shuffler-1" and descriptor.version == 1
    assert descriptor.url == PUBLIC_URL
    assert descriptor.signing_key == b64(public_bytes(signer))
    assert [k.model_dump() for k in descriptor.keys] == [
        {"key_id": key_id(hpke).hex(), "public_key": b64(public_bytes(hpke))}
    ]
    assert before <= descriptor.issued_at <= after
    assert descriptor.expires_at == descriptor.issued_at + TTL
    # The same key the shuffler opens contributions with (its /v1/config says so too).
    config = httpx.get(service.url + "/v1/config", timeout=10).json()
    assert config["public_key"] == descriptor.keys[0].public_key
    assert config["signing_key"] == descriptor.signing_key


@pytest.mark.system
def test_a_contribution_sealed_to_the_vouched_key_is_accepted(service: ServiceProcess) -> None:
    """The key in the descriptor is the one that opens contributions: a device that takes it
    from there gets a 202."""
    descriptor = ShufflerDescriptor.model_validate(_fetch(service).descriptor)
    key = load_x25519_public(base64.b64decode(descriptor.keys[0].public_key))
    token = httpx.post(service.url + "/v1/enroll", timeout=10).json()["client_token"]
    epoch = int(time.time() // int(SMALL_CHANNEL["epoch_seconds"]))  # type: ignore[call-overload]
    blob = seal_contribution(
        Contribution(
            channel_id="homepage",
            crowd_id="",
            epoch=epoch,
            nonce=new_nonce(),
            fragments=(bytes(72),),
        ),
        descriptor.id,
        key,
    )
    sent = httpx.post(
        service.url + "/v1/contributions",
        content=blob,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"},
        timeout=30,
    )
    assert sent.status_code == 202, sent.text


@pytest.mark.system
def test_no_one_else_can_vouch_and_nothing_in_it_can_be_changed(
    service: ServiceProcess, keys: Path
) -> None:
    document = _fetch(service)
    signer = load_or_create_ed25519(keys / "shuffler-1" / "keys" / "signing.pem").public_key()
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(CollectionConfigError, match="not signed by the key pinned"):
        verify_descriptor(document, other, time.time())
    substitute = X25519PrivateKey.generate().public_key()
    changes = {
        "url": "https://attacker.example.org",
        "keys": [{"key_id": key_id(substitute).hex(), "public_key": b64(public_bytes(substitute))}],
        "expires_at": document.descriptor["expires_at"] + 10**6,
        "id": "shuffler-2",
    }
    for field, value in changes.items():
        forged = SignedDescriptor(
            descriptor={**document.descriptor, field: value}, signature=document.signature
        )
        with pytest.raises(InvalidSignature):
            signer.verify(
                base64.b64decode(forged.signature),
                DESCRIPTOR_CONTEXT + canonical(forged.descriptor),
            )
        with pytest.raises(CollectionConfigError, match="not signed by the key pinned"):
            verify_descriptor(forged, signer, time.time())


@pytest.mark.system
def test_a_descriptor_is_refused_once_expired_and_each_fetch_is_fresh(
    service: ServiceProcess, keys: Path
) -> None:
    signer = load_or_create_ed25519(keys / "shuffler-1" / "keys" / "signing.pem").public_key()
    first = verify_descriptor(_fetch(service), signer, time.time())
    with pytest.raises(CollectionConfigError, match="expired"):
        verify_descriptor(_fetch(service), signer, first.expires_at + TTL + 1)
    time.sleep(1.1)
    second = verify_descriptor(_fetch(service), signer, time.time())
    assert second.issued_at > first.issued_at and second.expires_at == second.issued_at + TTL


def test_the_default_url_is_where_the_shuffler_listens(tmp_path: Path) -> None:
    settings = ShufflerSettings(
        database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
        key_dir=tmp_path / "keys",
        channels=[POLICY],
        host="127.0.0.1",
        port=8123,
    )
    assert settings.url == "http://127.0.0.1:8123"
    assert (
        ShufflerSettings(**{**settings.model_dump(), "public_url": "http://a/"}).url == "http://a"
    )


def test_every_live_key_is_listed_with_the_current_one_first(tmp_path: Path) -> None:
    """During a rotation the ring holds two keys: devices are given the current one (the first,
    what :meth:`ShufflerDescriptor.info` picks), contributions sealed to the other still open."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    current, previous = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    ring = KeyRing.of(current)
    ring.add(previous)
    signer = Ed25519PrivateKey.generate()
    clock = Clock()
    settings = ShufflerSettings(
        database_url=url, key_dir=tmp_path / "keys", channels=[POLICY], descriptor_ttl_seconds=3600
    )
    service = ShufflerService(settings, make_store(engine), ring, signer, clock)
    document = service.descriptor()
    descriptor = verify_descriptor(document, signer.public_key(), clock.now)
    assert [k.public_key for k in descriptor.keys] == [
        b64(public_bytes(current.public_key())),
        b64(public_bytes(previous.public_key())),
    ]
    assert descriptor.info().public_key == b64(public_bytes(current.public_key()))
    assert descriptor.issued_at == int(clock.now)
    assert descriptor.expires_at == int(clock.now) + 3600
    with pytest.raises(CollectionConfigError, match="expired"):
        verify_descriptor(document, signer.public_key(), clock.now + 3601)
    for key in (current, previous):
        blob = seal_contribution(
            Contribution(
                channel_id="homepage",
                crowd_id="",
                epoch=clock.epoch,
                nonce=new_nonce(),
                fragments=(bytes(72),),
            ),
            "shuffler-1",
            key.public_key(),
        )
        assert (
            service.validate(service.admit(service.tokens.issue()), blob).contribution.epoch
            == clock.epoch
        )


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bind_address_needs_a_public_url(host: str) -> None:
    """A descriptor vouching for http://0.0.0.0:8101 would send every device nowhere."""
    with pytest.raises(ValueError, match="set public_url"):
        ShufflerSettings(host=host)
    assert ShufflerSettings(host=host, public_url="http://shuffler-1:8101").url == (
        "http://shuffler-1:8101"
    )
