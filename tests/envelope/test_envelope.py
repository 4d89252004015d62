"""Context binding, tampering, padding, key rotation, key files and the contribution encoding."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from common.envelope import (
    Contribution,
    EnvelopeError,
    KeyRing,
    inner_size,
    load_or_create_x25519,
    new_nonce,
    open_contribution,
    open_fragment,
    pad,
    seal_contribution,
    seal_fragment,
    sign,
    unpad,
    verify,
    write_private_key,
)

ANALYZER = X25519PrivateKey.generate()
SHUFFLER = X25519PrivateKey.generate()


def test_fragment_sealed_for_channel_a_does_not_open_as_channel_b() -> None:
    ring = KeyRing.of(ANALYZER)
    blob = seal_fragment(b"\x01\x01\x00\x00\x00\x07", "channel-a", 16, ANALYZER.public_key())
    assert open_fragment(blob, "channel-a", ring) == b"\x01\x01\x00\x00\x00\x07"
    with pytest.raises(EnvelopeError):
        open_fragment(blob, "channel-b", ring)


def test_contribution_sealed_for_shuffler_1_does_not_open_at_shuffler_2() -> None:
    ring = KeyRing.of(SHUFFLER)
    contribution = Contribution("channel-a", "", 42, new_nonce(), (b"x" * 72,))
    blob = seal_contribution(contribution, "shuffler-1", SHUFFLER.public_key())
    assert open_contribution(blob, "shuffler-1", ring) == contribution
    with pytest.raises(EnvelopeError):
        open_contribution(blob, "shuffler-2", ring)


@pytest.mark.parametrize("position", [0, 5, 8, 20, 40, -1])
def test_tampered_bytes_fail(position: int) -> None:
    ring = KeyRing.of(ANALYZER)
    blob = bytearray(seal_fragment(b"\x01\x01abcd", "c", 16, ANALYZER.public_key()))
    blob[position] ^= 0x01
    with pytest.raises(EnvelopeError):
        open_fragment(bytes(blob), "c", ring)


def test_two_live_keys_open_in_flight_fragments() -> None:
    old, new = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    in_flight = seal_fragment(b"\x01\x01abcd", "c", 16, old.public_key())
    ring = KeyRing.of(new, old)
    assert ring.public() == ring.keys[ring.current].public_key()
    assert open_fragment(in_flight, "c", ring) == b"\x01\x01abcd"
    with pytest.raises(EnvelopeError, match="no live key"):
        open_fragment(in_flight, "c", KeyRing.of(new))


def test_ciphertext_length_does_not_depend_on_the_value() -> None:
    sizes = {
        len(seal_fragment(bytes([1, 1]) + bytes(v), "c", 16, ANALYZER.public_key()))
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


def test_signatures_cover_the_exact_bytes() -> None:
    key = Ed25519PrivateKey.generate()
    signature = sign(b'{"batch": 1}', key)
    assert verify(b'{"batch": 1}', signature, key.public_key())
    assert not verify(b'{"batch": 2}', signature, key.public_key())
    assert not verify(b'{"batch": 1}', signature, Ed25519PrivateKey.generate().public_key())


@pytest.mark.parametrize(
    "data",
    [b"", b"NOPE", b"ESA1\x05ab", b"ESA1\x01a\x00" + bytes(8) + bytes(16) + b"\x00\x01\x00\x09ab"],
)
def test_malformed_contributions_are_rejected(data: bytes) -> None:
    with pytest.raises(EnvelopeError):
        Contribution.decode(data)
