"""Signing keys rotate without re-pinning (common.collection.follow_successions): the old key
names the next in a succession, a verifier follows the chain from the key it pins, and a
device that moved its pin refuses a fork made later with an old key; the SDK keeps its moved
pins in its state file. Documents are signed here with real Ed25519 keys."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import (
    ANALYZER_PARTY,
    CollectionConfigError,
    TrustAnchors,
    check_moved,
    follow_successions,
    published_key,
    shuffler_party,
    sign_config,
    sign_descriptor,
    sign_succession,
    verify_collection,
    verify_config,
    verify_config_chain,
    verify_descriptor_chain,
)
from common.envelope import key_id, public_bytes
from common.wire import (
    MAX_EPOCH_SECONDS,
    MAX_SUCCESSIONS,
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    HpkeKey,
    ShufflerDescriptor,
    SignedConfig,
    SignedDescriptor,
    Succession,
    b64,
)
from encoder_client import Client, ConfigError

T0 = 1_900_000_000
CHANNEL = ChannelConfig(
    id="pages",
    mechanism="krr",
    params={"k": 4, "eps": 2.0},
    epoch_seconds=MAX_EPOCH_SECONDS,
    min_crowd=20,
)
HPKE = X25519PrivateKey.generate()


def _chain(party: str, keys: list[Ed25519PrivateKey], start: int = T0) -> list[Succession]:
    """Each key naming the next, a second apart."""
    return [
        sign_succession(party, old, new.public_key(), start + i)
        for i, (old, new) in enumerate(itertools.pairwise(keys))
    ]


def _hpke_key() -> HpkeKey:
    return HpkeKey(
        key_id=key_id(HPKE.public_key()).hex(), public_key=b64(public_bytes(HPKE.public_key()))
    )


def _descriptor(
    signer: Ed25519PrivateKey, successions: list[Succession], issued: int = T0
) -> SignedDescriptor:
    body = ShufflerDescriptor(
        id="shuffler-1",
        url="http://127.0.0.1:9",
        keys=[_hpke_key()],
        signing_key=b64(public_bytes(signer.public_key())),
        issued_at=issued,
        expires_at=issued + 10**6,
    )
    return sign_descriptor(body, signer, successions)


def _config(
    signer: Ed25519PrivateKey,
    successions: list[Succession],
    shuffler: SignedDescriptor,
    issued: int = T0,
) -> SignedConfig:
    body = CollectionConfig(
        issued_at=issued,
        expires_at=issued + 10**6,
        analyzer=AnalyzerInfo(
            url="http://127.0.0.1:9",
            keys=[_hpke_key()],
            signing_key=b64(public_bytes(signer.public_key())),
        ),
        shufflers=[shuffler],
        channels=[CHANNEL],
    )
    return sign_config(body, signer, successions)


def test_a_chain_leads_from_the_pinned_key_to_the_signer() -> None:
    keys = [Ed25519PrivateKey.generate() for _ in range(4)]
    chain = _chain(ANALYZER_PARTY, keys)
    lineage = follow_successions(chain, ANALYZER_PARTY, keys[0].public_key())
    assert [public_bytes(k) for k in lineage] == [public_bytes(k.public_key()) for k in keys]
    # A verifier whose pin moved to the third key follows from there on.
    moved = follow_successions(chain, ANALYZER_PARTY, keys[2].public_key())
    assert [public_bytes(k) for k in moved] == [public_bytes(k.public_key()) for k in keys[2:]]
    # No successions: the pinned key is the signer.
    assert follow_successions([], ANALYZER_PARTY, keys[0].public_key()) == (keys[0].public_key(),)


def test_a_link_not_signed_by_the_key_it_hands_over_from_is_refused() -> None:
    keys = [Ed25519PrivateKey.generate() for _ in range(3)]
    chain = _chain(ANALYZER_PARTY, keys)
    thief = Ed25519PrivateKey.generate()
    forged = sign_succession(ANALYZER_PARTY, thief, keys[2].public_key(), T0 + 1)
    chain[1] = forged.model_copy(update={"from_key": chain[1].from_key})
    with pytest.raises(CollectionConfigError, match=r"succession 1 .* not signed"):
        follow_successions(chain, ANALYZER_PARTY, keys[0].public_key())


def test_a_fork_from_an_old_key_is_refused_once_the_pin_moved() -> None:
    old, current, stolen_fork = (Ed25519PrivateKey.generate() for _ in range(3))
    honest = _chain(ANALYZER_PARTY, [old, current])
    fork = _chain(ANALYZER_PARTY, [old, stolen_fork])
    # Pinned at the old key, a verifier cannot tell the fork from the rotation...
    assert follow_successions(fork, ANALYZER_PARTY, old.public_key())[-1] == (
        stolen_fork.public_key()
    )
    # ...once it moved to the current key, the fork never reaches it.
    follow_successions(honest, ANALYZER_PARTY, current.public_key())
    with pytest.raises(CollectionConfigError, match="do not descend"):
        follow_successions(fork, ANALYZER_PARTY, current.public_key())


def test_chains_too_long_broken_backwards_or_for_another_party_are_refused() -> None:
    keys = [Ed25519PrivateKey.generate() for _ in range(MAX_SUCCESSIONS + 2)]
    with pytest.raises(CollectionConfigError, match=f"at most {MAX_SUCCESSIONS}"):
        follow_successions(_chain(ANALYZER_PARTY, keys), ANALYZER_PARTY, keys[0].public_key())
    a, b, c, d = keys[:4]
    broken = _chain(ANALYZER_PARTY, [a, b]) + _chain(ANALYZER_PARTY, [c, d])
    with pytest.raises(CollectionConfigError, match="does not start where"):
        follow_successions(broken, ANALYZER_PARTY, a.public_key())
    other = _chain(shuffler_party("shuffler-1"), [a, b])
    with pytest.raises(CollectionConfigError, match="speaks for"):
        follow_successions(other, ANALYZER_PARTY, a.public_key())
    backwards = [*_chain(ANALYZER_PARTY, [a, b], T0 + 10), *_chain(ANALYZER_PARTY, [b, c], T0)]
    with pytest.raises(CollectionConfigError, match="issued before"):
        follow_successions(backwards, ANALYZER_PARTY, a.public_key())
    cycle = _chain(ANALYZER_PARTY, [a, b, a])
    with pytest.raises(CollectionConfigError, match="twice"):
        follow_successions(cycle, ANALYZER_PARTY, a.public_key())
    too_long = _chain(ANALYZER_PARTY, keys)
    document = _config(keys[-1], [], _descriptor(a, [])).model_dump()
    document["successions"] = [s.model_dump() for s in too_long]
    with pytest.raises(CollectionConfigError, match=f"at most {MAX_SUCCESSIONS}"):
        verify_config(document, keys[0].public_key(), T0)


def test_a_config_signed_after_a_rotation_verifies_with_the_first_key() -> None:
    first, second = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    shuffler = _descriptor(Ed25519PrivateKey.generate(), [])
    rotated = _config(second, _chain(ANALYZER_PARTY, [first, second]), shuffler)
    vouched = verify_config_chain(rotated.model_dump(), first.public_key(), T0)
    assert vouched.signer == second.public_key() and len(vouched.lineage) == 2
    assert verify_config(rotated, second.public_key(), T0).issued_at == T0  # a moved pin
    # Without the succession, the new key means nothing to a device pinning the first.
    bare = _config(second, [], shuffler)
    with pytest.raises(CollectionConfigError, match="does not verify"):
        verify_config(bare, first.public_key(), T0)
    # A link the document does not carry cannot be skipped: the signer must be reached.
    with pytest.raises(CollectionConfigError, match="does not verify"):
        verify_config(rotated.model_dump() | {"successions": []}, first.public_key(), T0)


def test_a_descriptor_signed_after_a_rotation_names_its_new_key() -> None:
    first, second = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    chain = _chain(shuffler_party("shuffler-1"), [first, second])
    document = _descriptor(second, chain)
    assert verify_descriptor_chain(document, first.public_key(), T0).signer == second.public_key()
    assert published_key(document) == ("shuffler-1", second.public_key())
    # Another shuffler's succession does not hand shuffler-1's key over.
    stolen = _descriptor(second, _chain(shuffler_party("shuffler-2"), [first, second]))
    with pytest.raises(CollectionConfigError, match="speaks for"):
        verify_descriptor_chain(stolen, first.public_key(), T0)


def test_rollback_and_moved_pins_hold_across_a_rotation() -> None:
    """Versions stay keyed by the pinned (root) key, so a document issued before one the device
    accepted is a replay whichever key signed it; the lineage says where the pins move."""
    analyzer = [Ed25519PrivateKey.generate() for _ in range(2)]
    shuffler = [Ed25519PrivateKey.generate() for _ in range(2)]
    trust = TrustAnchors(analyzer[0].public_key(), {"shuffler-1": shuffler[0].public_key()})
    s_chain = _chain(shuffler_party("shuffler-1"), shuffler)
    a_chain = _chain(ANALYZER_PARTY, analyzer)
    new = _config(analyzer[1], a_chain, _descriptor(shuffler[1], s_chain, T0 + 10), T0 + 10)
    accepted = verify_collection(new.model_dump(), trust, T0 + 20)
    assert accepted.pins == {
        ANALYZER_PARTY: b64(public_bytes(analyzer[1].public_key())),
        shuffler_party("shuffler-1"): b64(public_bytes(shuffler[1].public_key())),
    }
    old = _config(analyzer[0], [], _descriptor(shuffler[0], []), T0)
    with pytest.raises(CollectionConfigError, match="older than one this device accepted"):
        verify_collection(old.model_dump(), trust, T0 + 20, accepted.versions)
    # Without the issue times, the moved pins still refuse the old keys' documents.
    before = verify_collection(old.model_dump(), trust, T0 + 20)
    with pytest.raises(CollectionConfigError, match="analyzer do not descend"):
        check_moved(before, accepted.pins)
    check_moved(accepted, accepted.pins)


def _client(tmp: Path, config: SignedConfig, trust: TrustAnchors) -> Client:
    (tmp / "config.json").write_text(config.model_dump_json())
    (tmp / "trust.json").write_text(json.dumps(trust.to_json()))
    return Client(
        config_file=tmp / "config.json",
        trust_file=tmp / "trust.json",
        state_path=tmp / "state.db",
        background=False,
        clock=lambda: T0 + 100,
    )


def test_a_device_follows_a_rotation_keeps_its_pin_moved_and_refuses_a_later_fork(
    tmp_path: Path,
) -> None:
    analyzer = [Ed25519PrivateKey.generate() for _ in range(2)]
    shuffler = Ed25519PrivateKey.generate()
    trust = TrustAnchors(analyzer[0].public_key(), {"shuffler-1": shuffler.public_key()})
    descriptor = _descriptor(shuffler, [])
    client = _client(tmp_path, _config(analyzer[0], [], descriptor), trust)
    rotated = _config(analyzer[1], _chain(ANALYZER_PARTY, analyzer), descriptor, T0 + 10)
    (tmp_path / "config.json").write_text(rotated.model_dump_json())
    client.refresh_config()
    roots = trust.roots()
    assert client.state.pins(roots)[ANALYZER_PARTY] == b64(public_bytes(analyzer[1].public_key()))

    # The first key is stolen after the rotation: its fork is newer, but does not descend
    # from the key the device moved to.
    fork_key = Ed25519PrivateKey.generate()
    fork = _config(fork_key, _chain(ANALYZER_PARTY, [analyzer[0], fork_key]), descriptor, T0 + 20)
    (tmp_path / "config.json").write_text(fork.model_dump_json())
    with pytest.raises(ConfigError, match="fork"):
        client.refresh_config()
    client.close()
    with pytest.raises(ConfigError, match="fork"):  # the moved pin outlives the process
        _client(tmp_path, fork, trust).close()
    # Given new root keys, the app starts a new history: the old moved pin no longer counts.
    repinned = TrustAnchors(fork_key.public_key(), {"shuffler-1": shuffler.public_key()})
    _client(tmp_path, fork, repinned).close()
