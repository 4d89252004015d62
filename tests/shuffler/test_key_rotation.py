"""Key rotation at a shuffler, through its app in process: a new HPKE key opens contributions
while pending and is published once active, the old one keeps opening through its overlap and,
once retired, gets 409 ``config_outdated`` (a device with a stale config, which then fetches
it again); a new signing key signs the descriptor with the succession from the first key and
the parts the forwarder sends (to a real HTTP receiver standing for the analyzer)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from fastapi.testclient import TestClient
from pydantic import ValidationError

from common.collection import published_key, shuffler_party, verify_descriptor_chain
from common.envelope import (
    Contribution,
    load_ed25519_public,
    load_or_create_ed25519,
    new_nonce,
    public_bytes,
    seal_contribution,
    verify,
)
from common.wire import MAX_EPOCH_SECONDS, ChannelPolicy, SignedDescriptor, b64, unb64
from runtime.keys import KeyDirectory
from shuffler.app import create_app
from shuffler.errors import MalformedContributionError
from shuffler.service import ShufflerService, build_service
from shuffler.settings import OVERLAP_MARGIN, ShufflerSettings

from ..support import receiver, wait_until
from .factory import POLICY

ADMIN = {"Authorization": "Bearer development"}


@pytest.fixture
def settings(tmp_path: Path) -> ShufflerSettings:
    return ShufflerSettings(
        database_url=f"sqlite:///{tmp_path / 'shuffler.db'}",
        key_dir=tmp_path / "keys",
        publish_dir=tmp_path / "public",
        channels=[POLICY],
        key_reload_seconds=0.05,
        key_activation_seconds=0.2,
        batch_interval_seconds=0.05,
    )


@pytest.fixture
def client(settings: ShufflerSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def _descriptor(client: TestClient) -> SignedDescriptor:
    return SignedDescriptor.model_validate(client.get("/v1/descriptor").json())


def _keys(document: SignedDescriptor) -> list[str]:
    return [k["key_id"] for k in document.descriptor["keys"]]


def _send(
    client: TestClient, key: dict[str, str], epoch: int, key_id: bytes | None = None
) -> httpx.Response:
    """One contribution of a fresh client, sealed to the HPKE key ``key`` names (``key_id``:
    naming another key id than its own)."""
    token = client.post("/v1/enroll").json()["client_token"]
    contribution = Contribution(
        channel_id=POLICY.id, crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=(bytes(72),)
    )
    public = X25519PublicKey.from_public_bytes(unb64(key["public_key"]))
    blob = seal_contribution(contribution, "shuffler-1", public)
    blob = blob if key_id is None else key_id + blob[len(key_id) :]
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
    response: httpx.Response = client.post("/v1/contributions", content=blob, headers=headers)
    return response


def _rotate(client: TestClient, kind: str) -> dict[str, Any]:
    """Rotate a key and wait until the listing shows it active."""
    made = client.post("/v1/admin/keys/rotate", json={"key": kind}, headers=ADMIN)
    assert made.status_code == 200, made.text
    new: dict[str, Any] = made.json()["key"]

    def active() -> bool:
        listed = client.get("/v1/admin/keys", headers=ADMIN).json()["keys"]
        return any(k["key_id"] == new["key_id"] and k["state"] == "active" for k in listed)

    wait_until(active, timeout=10, interval=0.05)
    return new


def test_a_rotated_hpke_key_overlaps_the_old_one_which_then_answers_config_outdated(
    client: TestClient,
) -> None:
    epoch = int(time.time() // POLICY.epoch_seconds)
    first = _descriptor(client)
    (old,) = first.descriptor["keys"]
    assert _send(client, old, epoch).status_code == 202

    new = _rotate(client, "hpke")
    rotated = _descriptor(client)
    assert _keys(rotated) == [new["key_id"], old["key_id"]]  # the new one first, the old listed
    assert _send(client, rotated.descriptor["keys"][0], epoch).status_code == 202
    assert _send(client, old, epoch).status_code == 202  # a device with the older descriptor

    retire = {"key": "hpke", "key_id": old["key_id"]}
    assert client.post("/v1/admin/keys/retire", json=retire, headers=ADMIN).status_code == 200
    assert _keys(_descriptor(client)) == [new["key_id"]]
    stale = _send(client, old, epoch)
    assert stale.status_code == 409 and stale.json()["error"] == "config_outdated", stale.text
    # A key id this shuffler never had is garbage, not a stale config.
    garbage = _send(client, rotated.descriptor["keys"][0], epoch, key_id=bytes(8))
    assert garbage.status_code == 400 and garbage.json()["error"] == "malformed", garbage.text


def test_a_rotated_signing_key_signs_the_descriptor_with_its_succession_and_the_parts_sent(
    settings: ShufflerSettings,
) -> None:
    root = load_or_create_ed25519(settings.key_dir / "signing.pem").public_key()
    with receiver() as analyzer:
        followed = settings.model_copy(update={"analyzer_url": analyzer.url})
        with TestClient(create_app(followed), raise_server_exceptions=False) as client:
            epoch = int(time.time() // POLICY.epoch_seconds)
            (key,) = _descriptor(client).descriptor["keys"]
            for _ in range(60):  # far above min_crowd after randomized deletion
                assert _send(client, key, epoch).status_code == 202
            new = _rotate(client, "signing")
            document = _descriptor(client)
            vouched = verify_descriptor_chain(document, root, None)
            assert vouched.signer == load_ed25519_public(unb64(new["public_key"]))
            assert [s.party for s in document.successions] == [shuffler_party("shuffler-1")]
            assert settings.publish_dir is not None
            published = settings.publish_dir / "shuffler-1.descriptor.json"

            def republished() -> bool:
                document = SignedDescriptor.model_validate_json(published.read_text())
                return published_key(document)[1] == vouched.signer

            wait_until(republished)
            closed = client.post(
                "/v1/admin/close", json={"channel_id": POLICY.id, "epoch": epoch}, headers=ADMIN
            )
            assert closed.status_code == 200 and closed.json()["groups_evaluated"] == 1
            wait_until(lambda: bool(analyzer.bodies))  # by the close, or the forwarding loop
        for body, signature in analyzer.bodies:
            assert json.loads(body)["shuffler_id"] == "shuffler-1"
            assert verify(body, unb64(signature), vouched.signer)
            assert not verify(body, unb64(signature), root)


def test_a_rotation_unsafe_with_a_channel_adopted_since_is_a_409_naming_the_overlap(
    settings: ShufflerSettings,
) -> None:
    """An explicit overlap checked against the channels at start can be too short for one
    the shuffler adopted since (from the analyzer's config): its rotations are refused as
    ``key_timing``, not as a storage failure; a year is the longest epoch there is."""
    overlap = settings.key_timing([POLICY]).hpke_overlap_seconds - OVERLAP_MARGIN
    fixed = settings.model_copy(update={"hpke_overlap_seconds": overlap})
    with pytest.raises(ValidationError, match="epoch_seconds"):
        ChannelPolicy(id="decade", epoch_seconds=10 * MAX_EPOCH_SECONDS)
    with TestClient(create_app(fixed), raise_server_exceptions=False) as client:
        assert client.post("/v1/admin/keys/rotate", json={"key": "hpke"}, headers=ADMIN).is_success
        service: ShufflerService = client.app.state.service  # type: ignore[attr-defined]
        long = POLICY.model_copy(
            update={
                "id": "yearly",
                "epoch_seconds": MAX_EPOCH_SECONDS,
                "min_crowd": 100,
                "delta_cr": 1e-9,
            }
        )
        adoption, _ = service.policies.adopt([POLICY, long], 1)
        assert adoption.added == ["yearly"], adoption
        refused = client.post("/v1/admin/keys/rotate", json={"key": "signing"}, headers=ADMIN)
        assert refused.status_code == 409 and refused.json()["error"] == "key_timing", refused.text
        assert "hpke_overlap_seconds" in refused.json()["detail"]


def test_a_key_another_replica_made_is_read_off_the_event_loop_and_a_failed_read_is_retryable(
    settings: ShufflerSettings,
) -> None:
    """Over HTTP: a contribution sealed to a key another replica has just made is opened once
    the changed key files are read again, in a worker thread (never on the event loop); when
    they cannot be read it gets 503 ``key_not_loaded`` with Retry-After, which a device
    retries (a 400 it would drop for good), and the retry is taken once they can."""
    slow = settings.model_copy(update={"key_reload_seconds": 3600, "key_activation_seconds": 7200})
    with TestClient(create_app(slow), raise_server_exceptions=False) as client:
        service: ShufflerService = client.app.state.service  # type: ignore[attr-defined]
        assert service.keys is not None
        on_loop: list[bool] = []
        read_again = service.intake.hooks.on_unknown_key
        assert read_again is not None

        def looked() -> bool:
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            return read_again()

        service.intake.hooks = replace(service.intake.hooks, on_unknown_key=looked)
        other = KeyDirectory(slow.key_dir, shuffler_party("shuffler-1"))
        made = other.rotate("hpke", time.time(), slow.key_timing([POLICY]))
        epoch = int(time.time() // POLICY.epoch_seconds)
        key = {"key_id": made.key_id, "public_key": made.public_key}
        pem = slow.key_dir / f"hpke-{made.key_id}.pem"
        pem.rename(pem.with_suffix(".away"))  # its file not there yet: the read fails
        lagging = _send(client, key, epoch)
        assert lagging.status_code == 503, lagging.text
        assert lagging.json()["error"] == "key_not_loaded"
        assert lagging.headers["retry-after"] == "1"
        pem.with_suffix(".away").rename(pem)
        service.keys.catch_up_seconds = 0.0  # the device's retry, a while later
        assert _send(client, key, epoch).status_code == 202
        assert on_loop == [False, False]


def _replicas(tmp_path: Path) -> list[ShufflerService]:
    """Two replicas of shuffler-1 sharing one key directory, reloading it hourly and
    publishing a new key two hours after it is made."""
    return [
        build_service(
            ShufflerSettings(
                database_url=f"sqlite:///{tmp_path / f'r{i}.db'}",
                key_dir=tmp_path / "keys",
                channels=[POLICY],
                key_reload_seconds=3600,
                key_activation_seconds=7200,
            )
        )
        for i in (1, 2)
    ]


def test_a_replica_reads_its_keys_again_when_a_contribution_names_one_it_lacks(
    tmp_path: Path,
) -> None:
    """A replica reloads its keys every ``key_reload_seconds``; one that meets a key id it does
    not hold (another replica rotated meanwhile) reads them at once, then opens it."""
    replicas = _replicas(tmp_path)
    first, second = (r.keys for r in replicas)
    assert first is not None and second is not None
    made = first.rotate("hpke").key  # pending: opened already, published in two hours
    epoch = int(time.time() // POLICY.epoch_seconds)
    contribution = Contribution(
        channel_id=POLICY.id, crowd_id="", epoch=epoch, nonce=new_nonce(), fragments=(bytes(72),)
    )
    public = X25519PublicKey.from_public_bytes(unb64(made.public_key))
    blob = seal_contribution(contribution, "shuffler-1", public)
    assert bytes.fromhex(made.key_id) not in second.ring.keys
    assert replicas[1].validate("c1", blob).contribution == contribution
    assert bytes.fromhex(made.key_id) in second.ring.keys
    # Garbage naming a key in no key file is malformed at once: the key files did not change
    # since they were read, so nothing is read again (anyone can send such a blob).
    reloads: list[str] = []
    second.reload = lambda: reloads.append("reload")  # type: ignore[method-assign]
    with pytest.raises(MalformedContributionError):
        replicas[1].validate("c2", bytes(8) + blob[8:])
    assert reloads == []
    for replica in replicas:
        replica.store.close()


def test_a_replica_that_has_not_reloaded_signs_with_the_new_key_from_its_activation_on(
    tmp_path: Path,
) -> None:
    """Replicas switch signing keys at the activation instant, not at their next reload: a
    lagging one would sign parts the analyzer refuses, and descriptors devices call a fork."""
    replicas = _replicas(tmp_path)
    first, second = (r.keys for r in replicas)
    assert first is not None and second is not None
    old = b64(public_bytes(replicas[1].signing_key.public_key()))
    made = first.rotate("signing").key
    second.reload()  # within key_reload_seconds of the rotation; not again before activation
    assert b64(public_bytes(replicas[1].signing_key.public_key())) == old
    first.clock = second.clock = lambda: made.activates_at
    for replica in replicas:
        assert b64(public_bytes(replica.signing_key.public_key())) == made.public_key
        assert replica.descriptor().descriptor["signing_key"] == made.public_key
        replica.store.close()
