"""Key rotation at the analyzer, in process: its HPKE and config-signing keys rotate through
the admin API (the token checked before the body); a pending key opens fragments before the
config names it; the config then names the new key first and is signed by the new signing key
with the succession devices follow; fragments sealed to the previous key open until it
retires (and while parts sealed to it wait), then no more. A shuffler's signing rotation is
followed through its descriptor, for descriptors and batches, and a fork is refused. The
opening pool's processes open with the keys of now (marked system: it starts processes)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from fastapi.testclient import TestClient

from analyzer.app import create_app
from analyzer.config import AnalyzerKeys, check_key_timing
from analyzer.errors import BadSignatureError
from analyzer.opening import FragmentOpener
from analyzer.service import MIGRATIONS, AnalyzerService
from analyzer.settings import DELIVERY_ALLOWANCE
from common.collection import (
    ANALYZER_PARTY,
    CollectionConfigError,
    TrustAnchors,
    shuffler_party,
    sign_descriptor,
    sign_succession,
    verify_collection,
    verify_config,
    verify_config_chain,
)
from common.envelope import FragmentContext, KeyRing, key_id, public_bytes, seal_fragment, sign
from common.wire import MAX_EPOCH_SECONDS, Batch, ShufflerDescriptor, SignedDescriptor, b64
from runtime import db
from runtime.keys import KeyTimingError

from .helpers import ANALYZER_KEY, CHANNEL, DESCRIPTORS, SHUFFLERS, app_settings, reports

ADMIN = {"Authorization": "Bearer development"}
VALUES = np.repeat(np.arange(3), 20)


@pytest.fixture
def analyzer(tmp_path: Path) -> Iterator[tuple[AnalyzerService, list[float]]]:
    """The analyzer service (migrated, descriptors seeded) on a clock the test moves."""
    now = [time.time()]
    service = AnalyzerService.from_settings(app_settings(tmp_path), clock=lambda: now[0])
    db.upgrade(service.store.engine, MIGRATIONS)
    service.catalog.refresh()
    service.descriptors.seed()
    yield service, now
    service.store.engine.dispose()


def _part(
    key: X25519PrivateKey,
    epoch: int,
    signer: str = "shuffler-1",
    by: Ed25519PrivateKey | None = None,
) -> tuple[bytes, str, str]:
    """A batch of 60 k-RAPPOR reports sealed to ``key`` for ``epoch``, signed as ``signer``."""
    context = FragmentContext(CHANNEL.id, epoch, "")
    fragments = [
        b64(seal_fragment(f, context, CHANNEL.payload_size, key.public_key()))
        for f in reports(VALUES, epoch)
    ]
    batch = Batch(
        batch_id=secrets.token_hex(16),
        shuffler_id=signer,
        channel_id=CHANNEL.id,
        epoch=epoch,
        crowd_id="",
        n_contributions=len(VALUES),
        fragments=fragments,
    )
    body = batch.body()
    return body, b64(sign(body, by or SHUFFLERS[signer])), signer


def _opened(service: AnalyzerService) -> tuple[int, int]:
    counts = service.store.fragment_ledger([CHANNEL.id]).get(CHANNEL.id)
    return (0, 0) if counts is None else (counts.opened, counts.invalid)


def _deliver(service: AnalyzerService, part: tuple[bytes, str, str]) -> str:
    """Store a part and open it: whether all of its fragments opened, or none did."""
    before = _opened(service)
    service.accept(*part)
    service.opener.open_pending()
    after = _opened(service)
    fragments = len(Batch.model_validate_json(part[0]).fragments)
    added = (after[0] - before[0], after[1] - before[1])
    return {(fragments, 0): "opened", (0, fragments): "refused"}.get(added, f"mixed {added}")


def _trust() -> TrustAnchors:
    return TrustAnchors(
        Ed25519PrivateKey.generate().public_key(),  # replaced by the test
        {name: key.public_key() for name, key in SHUFFLERS.items()},
    )


def test_the_admin_routes_check_the_token_first_and_refuse_what_would_break(
    tmp_path: Path,
) -> None:
    with TestClient(create_app(app_settings(tmp_path)), raise_server_exceptions=False) as client:
        for body in (b"{", b'{"key": "hpke"}'):
            refused = client.post("/v1/admin/keys/rotate", content=body)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"] == "bad_admin_token"
        assert client.get("/v1/admin/keys").status_code == 401
        bad = client.post("/v1/admin/keys/rotate", json={"key": "rsa"}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_request", bad.text
        made = client.post("/v1/admin/keys/rotate", json={"key": "hpke"}, headers=ADMIN)
        assert made.status_code == 200, made.text
        new = made.json()["key"]
        assert (new["kind"], new["state"], new["published"]) == ("hpke", "pending", False)
        again = client.post("/v1/admin/keys/rotate", json={"key": "hpke"}, headers=ADMIN)
        assert again.status_code == 409 and again.json()["error"] == "rotation_pending"
        current = key_id(ANALYZER_KEY.public_key()).hex()
        for kid, status, code in ((current, 409, "key_in_use"), ("ab" * 8, 404, "unknown_key")):
            answer = client.post(
                "/v1/admin/keys/retire", json={"key": "hpke", "key_id": kid}, headers=ADMIN
            )
            assert (answer.status_code, answer.json()["error"]) == (status, code), answer.text
        listed = client.get("/v1/admin/keys", headers=ADMIN).json()
        assert listed["party"] == ANALYZER_PARTY
        assert [(k["kind"], k["state"]) for k in listed["keys"]] == [
            ("hpke", "active"),
            ("signing", "active"),
            ("hpke", "pending"),
        ]


def test_the_config_follows_a_rotation_of_both_keys_and_devices_verify_it_with_the_first_key(
    analyzer: tuple[AnalyzerService, list[float]],
) -> None:
    service, now = analyzer
    root = service.keys.signing.public_key()
    trust = TrustAnchors(root, _trust().shufflers)
    before = verify_collection(service.config().model_dump(), trust, now[0])
    assert [k.key_id for k in before.analyzer.keys] == [key_id(ANALYZER_KEY.public_key()).hex()]

    hpke = service.keys.rotate("hpke").key
    signing = service.keys.rotate("signing").key
    pending = service.config()
    assert pending.successions == ()  # the new signer does not sign yet
    assert verify_config(pending.model_dump(), root, now[0]).analyzer.keys == before.analyzer.keys

    now[0] = hpke.activates_at + 1
    service.keys.reload()
    rotated = service.config()
    vouched = verify_config_chain(rotated.model_dump(), root, now[0])
    assert b64(public_bytes(vouched.signer)) == signing.public_key != b64(public_bytes(root))
    assert [k.key_id for k in vouched.value.analyzer.keys] == [
        hpke.key_id,
        key_id(ANALYZER_KEY.public_key()).hex(),
    ]
    verified = verify_collection(rotated.model_dump(), trust, now[0], before.versions)
    assert verified.pins[ANALYZER_PARTY] == signing.public_key


def test_fragments_open_with_a_pending_key_and_with_the_previous_one_until_it_retires(
    analyzer: tuple[AnalyzerService, list[float]],
) -> None:
    service, now = analyzer
    change = service.keys.rotate("hpke")
    new = X25519PrivateKey.from_private_bytes(
        service.keys.current.hpke[change.key.key_id].private_bytes_raw()
    )
    # Pending: devices are not told to use it, but what is sealed to it opens everywhere.
    assert _deliver(service, _part(new, 1)) == "opened"
    now[0] = change.key.activates_at + 1
    service.keys.reload()
    assert _deliver(service, _part(ANALYZER_KEY, 2)) == "opened"  # previous, overlapping
    assert _deliver(service, _part(new, 3)) == "opened"

    previous = next(k for k in change.keys.keys if k.key_id != change.key.key_id)
    waiting = _part(ANALYZER_KEY, 4)
    service.accept(*waiting)  # stored, not opened yet: the old key is held for it
    now[0] = change.key.activates_at + service.settings.key_timing([CHANNEL]).hpke_overlap_seconds
    service.keys.reload()
    assert previous.key_id in service.keys.current.hpke
    before = _opened(service)
    service.opener.open_pending()
    after = _opened(service)
    assert after[0] > before[0] and after[1] == before[1]  # every fragment opened
    # Nothing waits any more: the old key retires, its file is deleted, nothing opens with it.
    service.keys.reload()
    assert previous.key_id not in service.keys.current.hpke
    assert not (service.settings.key_dir / "hpke.pem").exists()
    assert _deliver(service, _part(ANALYZER_KEY, 5)) == "refused"
    assert _deliver(service, _part(new, 6)) == "opened"


def test_a_retired_key_is_held_only_for_parts_from_before_and_never_when_retired_early(
    analyzer: tuple[AnalyzerService, list[float]],
) -> None:
    service, now = analyzer
    change = service.keys.rotate("hpke")
    new = X25519PrivateKey.from_private_bytes(
        service.keys.current.hpke[change.key.key_id].private_bytes_raw()
    )
    old_id = key_id(ANALYZER_KEY.public_key()).hex()
    now[0] = change.key.activates_at + service.settings.key_timing([CHANNEL]).hpke_overlap_seconds
    service.accept(*_part(new, 1))  # stored after the old key retired, not opened yet
    service.keys.reload()
    assert service.store.unopened_parts() == 1
    assert old_id not in service.keys.current.hpke  # nothing from before it waits
    assert not (service.settings.key_dir / "hpke.pem").exists()

    second = service.keys.rotate("hpke")
    now[0] = second.key.activates_at + 1
    service.keys.reload()
    service.accept(*_part(new, 2))  # waits, stored before ``new`` would retire
    assert service.keys.current.hpke.keys() == {change.key.key_id, second.key.key_id}
    # An admin retires the previous key early (compromised): dropped at once, parts waiting.
    service.keys.retire(change.key.key_id)
    assert change.key.key_id not in service.keys.current.hpke
    assert not (service.settings.key_dir / f"hpke-{change.key.key_id}.pem").exists()
    service.opener.open_pending()  # what waited, sealed to that key, no longer opens
    opened, invalid = _opened(service)
    assert opened == 0 and invalid > 0 and service.store.unopened_parts() == 0


def test_a_channel_the_keys_could_not_rotate_with_is_refused_as_key_timing(
    tmp_path: Path,
) -> None:
    settings = app_settings(tmp_path)
    needed = settings.key_timing([CHANNEL]).hpke_overlap_seconds - DELIVERY_ALLOWANCE
    fixed = settings.model_copy(update={"hpke_overlap_seconds": needed})
    check_key_timing(fixed, [CHANNEL])
    yearly = CHANNEL.model_copy(update={"id": "yearly", "epoch_seconds": MAX_EPOCH_SECONDS})
    with pytest.raises(KeyTimingError, match="hpke_overlap_seconds"):
        check_key_timing(fixed, [CHANNEL, yearly])
    # Served already (added at runtime): rotations say why they are refused.
    keys = AnalyzerKeys.load(fixed, channels=lambda: [CHANNEL, yearly])
    with pytest.raises(KeyTimingError):
        keys.rotate("hpke")
    # Added at runtime: refused before it is published.
    with TestClient(create_app(fixed), raise_server_exceptions=False) as client:
        refused = client.post(
            "/v1/admin/channels", json=yearly.model_dump(mode="json"), headers=ADMIN
        )
        assert refused.status_code == 409 and refused.json()["error"] == "key_timing"
        assert "yearly" not in [c["id"] for c in client.get("/v1/channels").json()["channels"]]


def _rotated_descriptor(
    old: Ed25519PrivateKey, new: Ed25519PrivateKey, issued: int
) -> SignedDescriptor:
    """shuffler-1's descriptor after its signing key rotated from ``old`` to ``new``."""
    base = DESCRIPTORS["shuffler-1"].descriptor
    body = ShufflerDescriptor.model_validate(
        base | {"signing_key": b64(public_bytes(new.public_key())), "issued_at": issued}
    )
    link = sign_succession(shuffler_party("shuffler-1"), old, new.public_key(), issued)
    return sign_descriptor(body, new, [link])


def test_a_shuffler_signing_rotation_is_followed_for_batches_and_a_fork_is_refused(
    analyzer: tuple[AnalyzerService, list[float]],
) -> None:
    service, now = analyzer
    service.descriptors.renew_seconds = 0.0
    old, new = SHUFFLERS["shuffler-1"], Ed25519PrivateKey.generate()
    part = _part(ANALYZER_KEY, 1, by=new)
    with pytest.raises(BadSignatureError):  # nobody has seen the new key yet
        service.accept(*part)
    # Another worker fetched the shuffler's new descriptor: this one reads it on the next
    # bad signature, and the part is taken.
    other = AnalyzerService.from_settings(service.settings, clock=lambda: now[0])
    assert other.descriptors.offer(_rotated_descriptor(old, new, int(now[0]) + 1))
    assert not service.accept(*part).duplicate
    assert service.descriptors.signers["shuffler-1"] == new.public_key()
    # The old key no longer signs for shuffler-1, and a fork from it is refused.
    with pytest.raises(BadSignatureError):
        service.accept(*_part(ANALYZER_KEY, 2, by=old))
    fork = Ed25519PrivateKey.generate()
    with pytest.raises(CollectionConfigError, match="fork"):
        service.descriptors.offer(_rotated_descriptor(old, fork, int(now[0]) + 2))
    with pytest.raises(BadSignatureError):
        service.accept(*_part(ANALYZER_KEY, 3, by=fork))
    # The config carries the rotated descriptor, which devices pinning the old key follow.
    trust = TrustAnchors(service.keys.signing.public_key(), _trust().shufflers)
    verified = verify_collection(service.config().model_dump(), trust, now[0])
    assert verified.pins[shuffler_party("shuffler-1")] == b64(public_bytes(new.public_key()))


def test_a_restarted_analyzer_follows_a_rotated_key_even_once_its_descriptor_expired(
    analyzer: tuple[AnalyzerService, list[float]],
) -> None:
    service, now = analyzer
    old, new = SHUFFLERS["shuffler-1"], Ed25519PrivateKey.generate()
    rotated = _rotated_descriptor(old, new, int(now[0]) + 1)
    assert service.descriptors.offer(rotated)
    now[0] = rotated.descriptor["expires_at"] + 1.0  # the shuffler stopped; its descriptor expired
    restarted = AnalyzerService.from_settings(service.settings, clock=lambda: now[0])
    restarted.descriptors.seed()
    assert restarted.descriptors.signers["shuffler-1"] == new.public_key()
    with pytest.raises(BadSignatureError):  # a stolen old key does not sign for it again
        restarted.accept(*_part(ANALYZER_KEY, 4, by=old))
    restarted.store.engine.dispose()


@pytest.mark.system
def test_the_opening_pool_opens_with_the_keys_of_now() -> None:
    old, new = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    ring = KeyRing.of(old)
    opener = FragmentOpener(ring, 2, 5)
    context = FragmentContext(CHANNEL.id, 1, "")

    def sealed(key: X25519PrivateKey) -> list[str]:
        return [b64(seal_fragment(bytes([i]), context, 16, key.public_key())) for i in range(12)]

    try:
        assert opener.warm() == 2
        assert len(opener.open(context, sealed(old))) == 12
        assert opener.open(context, sealed(new)) == []
        ring.replace(KeyRing.of(new))  # what AnalyzerKeys does on a reload
        assert len(opener.open(context, sealed(new))) == 12
        assert opener.open(context, sealed(old)) == []
    finally:
        opener.close()
