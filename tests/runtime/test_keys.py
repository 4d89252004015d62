"""Key states in a party's key directory (runtime.keys): pending, active, retired, by time;
what each state opens and publishes; rotations, early retirement, pruning, the windows'
validation, and a directory made before rotations existed."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.collection import (
    MAX_CLOCK_SKEW_SECONDS,
    fingerprint,
    follow_successions,
    shuffler_party,
)
from common.envelope import (
    EnvelopeError,
    KeyRing,
    RetiredKeyError,
    key_id,
    load_or_create_ed25519,
    load_or_create_x25519,
    open_contribution,
    outer_info,
    seal,
)
from runtime.keys import (
    HPKE,
    SIGNING,
    STATE_FILE,
    KeyDirectory,
    KeyInUseError,
    KeyState,
    KeyStorageError,
    LiveKeys,
    NoSuchKeyError,
    PartyKeys,
    RotationPendingError,
    Timing,
    key_timing,
    overlap_floor,
)

PARTY = shuffler_party("shuffler-1")
T0 = 1_000_000.0
TIMING = Timing(activation_seconds=60, hpke_overlap_seconds=1000)


def _sealed(key: X25519PrivateKey) -> bytes:
    """Something sealed to ``key`` for shuffler-1 (opening it only needs the right key)."""
    return seal(b"x" * 40, key.public_key(), outer_info("shuffler-1"))


def _opens(ring: KeyRing, blob: bytes) -> bool:
    try:
        open_contribution(blob, "shuffler-1", ring)
    except RetiredKeyError:
        return False
    except EnvelopeError as error:  # opened, then not a contribution: the key was there
        return "magic" in str(error)
    return True


def test_a_directory_made_before_rotations_reads_as_its_files_all_active(tmp_path: Path) -> None:
    current = load_or_create_x25519(tmp_path / "hpke.pem")
    previous = load_or_create_x25519(tmp_path / "hpke-previous.pem")
    signer = load_or_create_ed25519(tmp_path / "signing.pem")
    keys = KeyDirectory(tmp_path, PARTY).load(T0)
    assert keys.published_hpke()[0].private_bytes_raw() == current.private_bytes_raw()
    assert [k.private_bytes_raw() for k in keys.published_hpke()] == [
        current.private_bytes_raw(),
        previous.private_bytes_raw(),
    ]
    assert keys.signer.private_bytes_raw() == signer.private_bytes_raw()
    assert keys.ring().current == key_id(current.public_key())
    assert keys.successions == ()
    assert not (tmp_path / STATE_FILE).exists()  # nothing written until a rotation


def test_a_rotated_hpke_key_is_pending_then_published_and_the_old_one_retires_after_overlap(
    tmp_path: Path,
) -> None:
    directory = KeyDirectory(tmp_path, PARTY)
    old = load_or_create_x25519(tmp_path / "hpke.pem")
    record = directory.rotate(HPKE, T0, TIMING)
    new = X25519PrivateKey.from_private_bytes(
        directory.load(T0).hpke[record.key_id].private_bytes_raw()
    )
    assert record.state(T0) is KeyState.PENDING and record.activates_at == T0 + 60

    pending = directory.load(T0 + 1)
    # Pending: every replica opens what is sealed to it, nobody is told to use it yet.
    assert [k.public_key() == old.public_key() for k in pending.published_hpke()] == [True]
    assert _opens(pending.ring(), _sealed(new)) and _opens(pending.ring(), _sealed(old))

    active = directory.load(T0 + 61)
    assert active.published_hpke()[0].private_bytes_raw() == new.private_bytes_raw()
    assert len(active.published_hpke()) == 2  # the old one still listed through its overlap
    assert _opens(active.ring(), _sealed(old))

    retired = directory.load(T0 + 60 + 1000)
    assert len(retired.published_hpke()) == 1
    assert not _opens(retired.ring(), _sealed(old))  # retired: named, refused, not garbage
    with pytest.raises(RetiredKeyError):
        open_contribution(_sealed(old), "shuffler-1", retired.ring())
    listing = retired.listing(PARTY)
    assert [(k.key_id, k.state, k.published) for k in listing.keys if k.kind == HPKE] == [
        (key_id(old.public_key()).hex(), "retired", False),
        (record.key_id, "active", True),
    ]


def test_a_second_rotation_waits_until_the_pending_key_is_active(tmp_path: Path) -> None:
    directory = KeyDirectory(tmp_path, PARTY)
    directory.rotate(HPKE, T0, TIMING)
    with pytest.raises(RotationPendingError):
        directory.rotate(HPKE, T0 + 59, TIMING)
    directory.rotate(SIGNING, T0 + 1, TIMING)  # another kind is not held up
    third = directory.rotate(HPKE, T0 + 60, TIMING)
    book = directory.book()
    # Both earlier HPKE keys end with the third's overlap at the latest.
    ends = [r.retires_at for r in book.records if r.kind == HPKE and r.key_id != third.key_id]
    assert ends == [T0 + 60 + 1000, T0 + 120 + 1000]


def test_a_signing_rotation_is_a_succession_documents_carry_once_the_key_signs(
    tmp_path: Path,
) -> None:
    directory = KeyDirectory(tmp_path, PARTY)
    first = load_or_create_ed25519(tmp_path / "signing.pem")
    record = directory.rotate(SIGNING, T0, TIMING)
    pending = directory.load(T0 + 1)
    # Still signing with the first key: no document may carry a link past its signer.
    assert pending.signer.private_bytes_raw() == first.private_bytes_raw()
    assert pending.successions == () and len(pending.book.successions) == 1
    active = directory.load(T0 + 60)
    assert active.signer is active.signing[record.key_id]
    (link,) = active.successions
    lineage = follow_successions(active.successions, PARTY, first.public_key())
    assert lineage[-1] == active.signer.public_key()
    assert link.issued_at == int(T0)
    assert [k.state for k in active.listing(PARTY).keys if k.kind == SIGNING] == [
        "retired",
        "active",
    ]
    # Its file is deleted once every replica's clock is past its retirement: whoever takes
    # the directory later cannot fork the chain from it.
    assert directory.prune(T0 + 60) == [] and (tmp_path / "signing.pem").exists()
    assert directory.prune(T0 + 60 + MAX_CLOCK_SKEW_SECONDS) == [fingerprint(first.public_key())]
    assert not (tmp_path / "signing.pem").exists()
    assert directory.load(T0 + 400).signer is not None


def test_retiring_early_refuses_the_published_and_pending_keys(tmp_path: Path) -> None:
    directory = KeyDirectory(tmp_path, PARTY)
    old = load_or_create_x25519(tmp_path / "hpke.pem")
    old_id = key_id(old.public_key()).hex()
    with pytest.raises(KeyInUseError):
        directory.retire(old_id, T0)
    new = directory.rotate(HPKE, T0, TIMING)
    with pytest.raises(KeyInUseError):
        directory.retire(new.key_id, T0 + 1)  # pending
    with pytest.raises(KeyInUseError):
        directory.retire(old_id, T0 + 1)  # still the published one
    with pytest.raises(NoSuchKeyError):
        directory.retire("00" * 8, T0 + 61)
    retired = directory.retire(old_id, T0 + 61)
    assert retired.state(T0 + 61) is KeyState.RETIRED
    assert directory.retire(old_id, T0 + 62) == retired  # again: nothing changes
    assert directory.prune(T0 + 62) == [old_id]
    assert not (tmp_path / "hpke.pem").exists()
    keys = directory.load(T0 + 62)
    assert old_id not in keys.hpke and bytes.fromhex(old_id) in keys.ring().retired


def test_held_retired_keys_stay_in_the_ring_and_on_disk(tmp_path: Path) -> None:
    """The analyzer holds a retired key while parts stored before it retired wait."""
    directory = KeyDirectory(tmp_path, PARTY)
    old = load_or_create_x25519(tmp_path / "hpke.pem")
    directory.rotate(HPKE, T0, TIMING)
    retires_at = T0 + 60 + 1000
    waiting: list[float | None] = [retires_at - 1]  # a part from before it retired waits
    live = LiveKeys(
        directory, lambda: TIMING, clock=lambda: T0 + 2000, waiting_since=lambda: waiting[0]
    )
    ring = live.ring
    assert _opens(ring, _sealed(old)) and (tmp_path / "hpke.pem").exists()
    live.reload()
    assert _opens(ring, _sealed(old))
    waiting[0] = retires_at + 1  # only parts stored after it retired wait: not held
    live.reload()
    assert live.ring is ring  # refilled in place: every holder sees it
    assert not _opens(ring, _sealed(old)) and not (tmp_path / "hpke.pem").exists()


def test_a_key_retired_early_is_never_held_even_while_parts_wait(tmp_path: Path) -> None:
    """The compromised-key runbook: ``esa keys retire`` drops the key at once, also from a
    replica starting while its file is still there."""
    directory = KeyDirectory(tmp_path, PARTY)
    old = load_or_create_x25519(tmp_path / "hpke.pem")
    directory.rotate(HPKE, T0, TIMING)
    live = LiveKeys(
        directory, lambda: TIMING, clock=lambda: T0 + 61, waiting_since=lambda: -math.inf
    )
    assert _opens(live.ring, _sealed(old))
    directory.retire(key_id(old.public_key()).hex(), T0 + 61)  # another replica retires it
    starting = LiveKeys(directory, lambda: TIMING, clock=lambda: T0 + 62)
    assert (tmp_path / "hpke.pem").exists() and not _opens(starting.ring, _sealed(old))
    live.reload()
    assert not _opens(live.ring, _sealed(old)) and not (tmp_path / "hpke.pem").exists()


def test_every_replica_picks_up_a_rotation_and_listeners_hear_of_state_changes(
    tmp_path: Path,
) -> None:
    now = [T0]
    replicas = [
        LiveKeys(KeyDirectory(tmp_path, PARTY), lambda: TIMING, clock=lambda: now[0])
        for _ in range(2)
    ]
    heard: list[int] = []

    def listener(index: int) -> Callable[[PartyKeys], None]:
        return lambda _keys: heard.append(index)

    for index, replica in enumerate(replicas):
        replica.listeners.append(listener(index))
    change = replicas[0].rotate(SIGNING)
    assert change.key.state == "pending" and heard == [0]
    replicas[1].reload()
    assert heard == [0, 1]
    assert change.key.key_id in replicas[1].current.signing  # loaded before it signs
    now[0] = T0 + 60
    for replica in replicas:
        replica.reload()
        assert replica.current.signer is replica.current.signing[change.key.key_id]
    assert heard == [0, 1, 0, 1]
    replicas[1].reload()
    assert heard == [0, 1, 0, 1]  # no change, nobody told


def test_replicas_switch_keys_at_activation_whenever_they_last_reloaded(
    tmp_path: Path,
) -> None:
    """A replica that loaded the pending key signs with it from its activation on, without
    reloading: no replica signs with the old key after devices moved their pins."""
    now = [T0]
    replicas = [
        LiveKeys(KeyDirectory(tmp_path, PARTY), lambda: TIMING, clock=lambda: now[0])
        for _ in range(2)
    ]
    old = replicas[1].current.signer.private_bytes_raw()
    change = replicas[0].rotate(SIGNING)
    # keys.json changed since replica 1 read it: a blob naming a key it lacks reads it again.
    assert replicas[1].stale() and not replicas[0].stale()
    assert replicas[1].catch_up() and not replicas[1].stale()  # the pending key is loaded
    assert replicas[1].current.signer.private_bytes_raw() == old
    now[0] = change.key.activates_at
    for replica in replicas:
        assert replica.current.signer is replica.current.signing[change.key.key_id]
        assert len(replica.current.successions) == 1


def test_listeners_end_with_the_newest_keys_when_reloads_overlap(tmp_path: Path) -> None:
    """A reload whose listener is slow must not undo what a later reload told them."""
    directory = KeyDirectory(tmp_path, PARTY)
    live = LiveKeys(directory, lambda: TIMING, clock=lambda: T0)
    applied: list[frozenset[str]] = []
    entered, release = threading.Event(), threading.Event()

    def slow_listener(keys: PartyKeys) -> None:
        if not entered.is_set():
            entered.set()
            release.wait()
        applied.append(frozenset([*keys.hpke, *keys.signing]))  # the last one told wins

    live.listeners.append(slow_listener)
    directory.rotate(SIGNING, T0, TIMING)
    earlier = threading.Thread(target=live.reload, daemon=True)
    later = threading.Thread(target=live.reload, daemon=True)
    try:
        earlier.start()
        entered.wait()  # the first reload is telling its listener of the new pending key
        directory.rotate(HPKE, T0, TIMING)
        later.start()
        later.join(timeout=0.5)  # before the fix it told its listener at once, and ended
    finally:
        release.set()
    earlier.join()
    later.join()
    newest = live.current
    assert len(applied) == 2 and applied[-1] == frozenset([*newest.hpke, *newest.signing])


def test_listing_the_keys_changes_nothing(tmp_path: Path) -> None:
    """``GET /v1/admin/keys`` is a read: no key file deleted, nothing reloaded or told."""
    directory = KeyDirectory(tmp_path, PARTY)
    old = load_or_create_x25519(tmp_path / "hpke.pem")
    now = [T0]
    live = LiveKeys(directory, lambda: TIMING, clock=lambda: now[0])
    heard: list[PartyKeys] = []
    live.listeners.append(heard.append)
    live.rotate(HPKE)
    heard.clear()
    now[0] = T0 + 60 + 1000
    states = [k.state for k in live.listing().keys if k.kind == HPKE]
    assert states == ["retired", "active"]
    assert (tmp_path / "hpke.pem").exists() and _opens(live.ring, _sealed(old)) and not heard
    live.reload()
    assert not (tmp_path / "hpke.pem").exists() and not _opens(live.ring, _sealed(old))
    assert len(heard) == 1


def test_a_key_file_that_is_not_the_key_named_is_refused(tmp_path: Path) -> None:
    directory = KeyDirectory(tmp_path, PARTY)
    record = directory.rotate(HPKE, T0, TIMING)
    (tmp_path / record.file).unlink()
    with pytest.raises(ValueError, match="missing"):
        directory.load(T0)
    swapped = Ed25519PrivateKey.generate()
    from common.envelope import write_private_key

    write_private_key(tmp_path / record.file, swapped)
    with pytest.raises(ValueError, match="does not hold"):
        directory.load(T0)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["version"] = 7
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="version 1"):
        directory.book()


def test_windows_that_could_lose_sealed_contributions_are_refused() -> None:
    floor = overlap_floor(3600, 600, 2)
    assert floor == 3600 + 300 + 600 + 2
    assert key_timing(10, 60, None, floor, 100).hpke_overlap_seconds == floor + 100
    assert key_timing(10, 60, floor, floor, 100).hpke_overlap_seconds == floor
    with pytest.raises(ValueError, match="hpke_overlap_seconds"):
        key_timing(10, 60, floor - 1, floor, 100)
    with pytest.raises(ValueError, match="twice"):
        key_timing(10, 19, None, floor, 100)


def test_settings_derive_and_check_the_windows(tmp_path: Path) -> None:
    from analyzer.settings import DELIVERY_ALLOWANCE, AnalyzerSettings
    from shuffler.settings import OVERLAP_MARGIN, ShufflerSettings
    from tests.support import LONG_EPOCH_CHANNEL

    analyzer = AnalyzerSettings(key_dir=tmp_path, config_ttl_seconds=3600)
    assert analyzer.key_timing([LONG_EPOCH_CHANNEL]).hpke_overlap_seconds == (
        overlap_floor(3600, LONG_EPOCH_CHANNEL.epoch_seconds, 60) + DELIVERY_ALLOWANCE
    )
    with pytest.raises(ValueError, match="hpke_overlap_seconds"):
        AnalyzerSettings(key_dir=tmp_path, config_ttl_seconds=3600, hpke_overlap_seconds=3600)
    with pytest.raises(ValueError, match="key_activation_seconds"):
        ShufflerSettings(key_dir=tmp_path, key_reload_seconds=5, key_activation_seconds=9)
    shuffler = ShufflerSettings(key_dir=tmp_path, descriptor_ttl_seconds=600)
    assert shuffler.key_timing([]).hpke_overlap_seconds == 600 + 300 + 2 + OVERLAP_MARGIN


def test_an_unusable_key_directory_is_a_storage_error_for_an_admin(tmp_path: Path) -> None:
    live = LiveKeys(KeyDirectory(tmp_path, PARTY), lambda: TIMING, clock=lambda: T0)
    (tmp_path / STATE_FILE).write_text("{not json")
    for action in (live.listing, lambda: live.rotate(HPKE)):
        with pytest.raises(KeyStorageError, match=STATE_FILE):
            action()
    assert live.current.signer is not None  # the keys in use stay


def _rotated_twice(tmp_path: Path) -> KeyDirectory:
    """A directory whose HPKE key and signing key rotated (both new keys active at T0 + 61)."""
    directory = KeyDirectory(tmp_path, PARTY)
    directory.rotate(HPKE, T0, TIMING)
    directory.rotate(SIGNING, T0, TIMING)
    return directory


def test_a_lost_key_state_file_never_brings_back_the_first_keys(tmp_path: Path) -> None:
    directory = _rotated_twice(tmp_path)
    (tmp_path / STATE_FILE).unlink()
    with pytest.raises(ValueError, match="restore it from a backup"):
        directory.load(T0 + 61)


@pytest.mark.parametrize("damage", ["every hpke key retired", "no signing key"])
def test_a_state_file_naming_no_usable_key_is_refused_and_deletes_nothing(
    tmp_path: Path, damage: str
) -> None:
    directory = _rotated_twice(tmp_path)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    if damage == "no signing key":
        state["keys"] = [k for k in state["keys"] if k["kind"] != SIGNING]
    else:
        for key in state["keys"]:
            key["retires_at"] = T0 if key["kind"] == HPKE else key["retires_at"]
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    files = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="names no active"):
        directory.load(T0 + 61)
    with pytest.raises(ValueError, match="names no active"):
        directory.prune(T0 + 10**6)
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # no private key deleted


def test_a_state_file_with_fields_of_the_wrong_type_is_a_storage_error(tmp_path: Path) -> None:
    _rotated_twice(tmp_path)
    live = LiveKeys(KeyDirectory(tmp_path, PARTY), lambda: TIMING, clock=lambda: T0 + 61)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["keys"][0]["activates_at"] = "soon"
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    for action in (live.listing, lambda: live.rotate(HPKE)):
        with pytest.raises(KeyStorageError, match="activates_at"):
            action()
