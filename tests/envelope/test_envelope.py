"""Context binding, tampering, padding, key rotation, key files and the contribution encoding."""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.envelope import (
    INNER_INFO,
    Contribution,
    EnvelopeError,
    FragmentContext,
    KeyRing,
    WireVersionError,
    inner_size,
    load_or_create_x25519,
    new_nonce,
    open_contribution,
    open_fragment,
    outer_info,
    pad,
    seal,
    seal_contribution,
    seal_fragment,
    sign,
    unpad,
    verify,
    write_private_key,
)

ANALYZER = X25519PrivateKey.generate()
SHUFFLER = X25519PrivateKey.generate()
#: A fragment's usual context in these tests: channel "c", epoch 7, the default crowd.
C = FragmentContext("c", 7, "")


def test_fragment_sealed_for_channel_a_does_not_open_as_channel_b() -> None:
    ring = KeyRing.of(ANALYZER)
    context = FragmentContext("channel-a", 7, "")
    blob = seal_fragment(b"\x01\x01\x00\x00\x00\x07", context, 16, ANALYZER.public_key())
    assert open_fragment(blob, context, ring) == b"\x01\x01\x00\x00\x00\x07"
    with pytest.raises(EnvelopeError):
        open_fragment(blob, FragmentContext("channel-b", 7, ""), ring)


@pytest.mark.parametrize(
    "other",
    [
        FragmentContext("channel-a", 8, "eu"),  # the next epoch's batch
        FragmentContext("channel-a", 6, "eu"),  # an earlier epoch's
        FragmentContext("channel-a", 7, "us"),  # another crowd's batch
        FragmentContext("channel-a", 7, ""),  # the default crowd
        FragmentContext("channel-b", 7, "eu"),  # another channel
    ],
)
def test_a_fragment_opens_only_in_its_own_channel_epoch_and_crowd(other: FragmentContext) -> None:
    """A shuffler that moves a fragment into another group's batch sends one that no longer
    opens (wire version 2): the analyzer opens with the batch header's channel, epoch, crowd."""
    ring = KeyRing.of(ANALYZER)
    own = FragmentContext("channel-a", 7, "eu")
    blob = seal_fragment(b"\x01\x01abcd", own, 16, ANALYZER.public_key())
    assert open_fragment(blob, own, ring) == b"\x01\x01abcd"
    assert open_fragment(blob, own.info(), ring) == b"\x01\x01abcd"  # precomputed info
    with pytest.raises(EnvelopeError, match="does not open"):
        open_fragment(blob, other, ring)


def test_fragment_context_info_is_unambiguous() -> None:
    """Length prefixes keep ("ab", "c") and ("a", "bc") apart; the epoch is fixed width."""
    info = FragmentContext("ab", 1, "c").info()
    assert info == INNER_INFO + b"\x02ab" + (1).to_bytes(8, "big") + b"\x01c"
    assert info != FragmentContext("a", 1, "bc").info()
    assert len({FragmentContext("c", e, "").info() for e in (0, 1, 256, 2**63)}) == 4
    for bad in (FragmentContext("x" * 256, 1, ""), FragmentContext("c", -1, ""),
                FragmentContext("c", 1 << 64, ""), FragmentContext("c", 1, "y" * 256)):  # fmt: skip
        with pytest.raises(ValueError, match="no fragment context"):
            bad.info()


def test_contribution_sealed_for_shuffler_1_does_not_open_at_shuffler_2() -> None:
    ring = KeyRing.of(SHUFFLER)
    contribution = Contribution(
        channel_id="channel-a", crowd_id="", epoch=42, nonce=new_nonce(), fragments=(b"x" * 72,)
    )
    blob = seal_contribution(contribution, "shuffler-1", SHUFFLER.public_key())
    assert open_contribution(blob, "shuffler-1", ring) == contribution
    with pytest.raises(EnvelopeError):
        open_contribution(blob, "shuffler-2", ring)


@pytest.mark.parametrize("position", [0, 5, 8, 20, 40, -1])
def test_tampered_bytes_fail(position: int) -> None:
    ring = KeyRing.of(ANALYZER)
    blob = bytearray(seal_fragment(b"\x01\x01abcd", C, 16, ANALYZER.public_key()))
    assert open_fragment(bytes(blob), C, ring) == b"\x01\x01abcd"
    blob[position] ^= 0x01
    with pytest.raises(EnvelopeError):
        open_fragment(bytes(blob), C, ring)


def test_two_live_keys_open_in_flight_fragments() -> None:
    old, new = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    in_flight = seal_fragment(b"\x01\x01abcd", C, 16, old.public_key())
    ring = KeyRing.of(new, old)
    assert ring.public() == ring.keys[ring.current].public_key()
    assert open_fragment(in_flight, C, ring) == b"\x01\x01abcd"
    with pytest.raises(EnvelopeError, match="no live key"):
        open_fragment(in_flight, C, KeyRing.of(new))


def test_ciphertext_length_does_not_depend_on_the_value() -> None:
    sizes = {
        len(seal_fragment(bytes([1, 1]) + bytes(v), C, 16, ANALYZER.public_key()))
        for v in range(0, 7)
    }
    assert sizes == {inner_size(16)}
    assert unpad(pad(b"abc", 10)) == b"abc"
    with pytest.raises(ValueError, match="do not fit"):
        pad(b"x" * 9, 10)
    with pytest.raises(EnvelopeError, match="padding"):
        unpad(b"\x00\x01ab")


def test_key_files_are_0600_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "hpke.pem"
    key = load_or_create_x25519(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_x25519(path).private_bytes_raw() == key.private_bytes_raw()
    with pytest.raises(FileExistsError):
        write_private_key(path, X25519PrivateKey.generate())


def test_workers_starting_together_load_one_key_and_never_a_partial_file(tmp_path: Path) -> None:
    """Two analyzer workers start at once on an empty key folder: every one of them loads the
    same key (the first written), none reads a half-written PEM or fails on the other's file."""

    def start(path: Path, barrier: threading.Barrier) -> bytes:
        barrier.wait()
        return load_or_create_x25519(path).private_bytes_raw()

    for round_ in range(20):
        path = tmp_path / f"round-{round_}" / "hpke.pem"
        barrier = threading.Barrier(8)
        with ThreadPoolExecutor(8) as pool:
            keys = list(pool.map(start, [path] * 8, [barrier] * 8))
        assert len(set(keys)) == 1
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert [p.name for p in path.parent.iterdir()] == ["hpke.pem"]  # no temporary left


def test_signatures_cover_the_exact_bytes() -> None:
    key = Ed25519PrivateKey.generate()
    signature = sign(b'{"batch": 1}', key)
    assert verify(b'{"batch": 1}', signature, key.public_key())
    assert not verify(b'{"batch": 2}', signature, key.public_key())
    assert not verify(b'{"batch": 1}', signature, Ed25519PrivateKey.generate().public_key())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"NOPE",
        b"ESA2\x05ab",
        b"ESA2\x01a\x00" + bytes(8) + bytes(16) + b"\x00\x01\x00\x09ab",  # truncated fragment
        b"ESA2\x01a\x00" + bytes(8) + bytes(16) + b"\x00\x00" + b"extra",  # trailing bytes
    ],
)
def test_malformed_contributions_are_rejected(data: bytes) -> None:
    with pytest.raises(EnvelopeError) as raised:
        Contribution.decode(data)
    assert not isinstance(raised.value, WireVersionError)


def test_wire_version_1_contributions_are_refused_by_name() -> None:
    """A well-formed version 1 contribution (fragments bound to their channel only) is refused
    as a version the client must update from, not parsed, not as merely malformed."""
    current = Contribution(
        channel_id="channel-a", crowd_id="", epoch=42, nonce=new_nonce(), fragments=(b"x" * 72,)
    )
    encoded = current.encode()
    assert encoded[:4] == b"ESA2"
    assert Contribution.decode(encoded) == current
    with pytest.raises(WireVersionError, match="wire version 1"):
        Contribution.decode(b"ESA1" + encoded[4:])
    ring = KeyRing.of(SHUFFLER)
    old = seal(b"ESA1" + encoded[4:], SHUFFLER.public_key(), outer_info("shuffler-1"))
    with pytest.raises(WireVersionError):
        open_contribution(old, "shuffler-1", ring)
