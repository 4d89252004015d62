"""Sealed envelopes: HPKE (RFC 9180) through ``cryptography``, fixed-size padding, key files.

One-shot HPKE in our suite (docs/protocol-notes.md, "Sealed envelopes": DHKEM(X25519),
HKDF-SHA256, AES-128-GCM, base mode);
we never compose KEM/KDF/AEAD ourselves. HPKE ``info`` binds a fragment to its channel, epoch
and crowd (:class:`FragmentContext`), so one re-sent in another epoch's or crowd's batch opens
for nobody, and a contribution to its shuffler. Blobs start with an 8-byte key id naming one of
the recipient's live keys (keys rotate without dropping in-flight fragments); inner plaintexts
are padded to the channel's ``payload_size`` so length never reveals the value. Wire version 1
is refused with :class:`WireVersionError`.

Byte layouts: docs/protocol-notes.md, "Sealed envelopes".
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

from common.files import create_once
from common.formats import CONTRIBUTION_MAGIC, OLD_CONTRIBUTION_MAGIC

SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)
INNER_INFO = b"esa/2 inner "
OUTER_INFO = b"esa/1 outer "
KEY_ID_SIZE = 8
ENC_SIZE = 32
TAG_SIZE = 16
NONCE_SIZE = 16
#: Reads a fragment's length (``uint16``, big-endian) in place, without slicing it out.
_U16 = struct.Struct(">H").unpack_from
MAGIC = CONTRIBUTION_MAGIC
#: The magic of wire version 1 contributions, refused by name.
OLD_MAGIC = OLD_CONTRIBUTION_MAGIC
PrivateKey = TypeVar("PrivateKey", X25519PrivateKey, Ed25519PrivateKey)


class EnvelopeError(ValueError):
    """A blob that does not open or parse (wrong key, channel, shuffler, tampered, malformed)."""


class WireVersionError(EnvelopeError):
    """A contribution of a wire version this code no longer takes (the client must update)."""


class RetiredKeyError(EnvelopeError):
    """A blob sealed to a key its recipient has retired (the sender's config is outdated)."""


class UnknownKeyError(EnvelopeError):
    """A blob naming a key id its recipient's ring does not hold (garbage, or a key another
    replica of the recipient has just made)."""


def key_id(public_key: X25519PublicKey) -> bytes:
    """First 8 bytes of SHA-256 of the raw public key."""
    return hashlib.sha256(public_key.public_bytes_raw()).digest()[:KEY_ID_SIZE]


def public_bytes(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    """Raw 32-byte public key (published, base64, in the collection config)."""
    return key.public_bytes_raw()


def public_identity(hpke: X25519PublicKey, signing: Ed25519PublicKey) -> dict[str, str]:
    """A shuffler's public keys as its registry entry and ``GET /v1/config`` carry them
    (docs/protocol-notes.md): base64 raw X25519 key, its key id in hex, base64 raw Ed25519 key."""
    return {
        "public_key": base64.b64encode(public_bytes(hpke)).decode(),
        "key_id": key_id(hpke).hex(),
        "signing_key": base64.b64encode(public_bytes(signing)).decode(),
    }


def load_x25519_public(raw: bytes) -> X25519PublicKey:
    """Inverse of :func:`public_bytes` for X25519."""
    return X25519PublicKey.from_public_bytes(raw)


def load_ed25519_public(raw: bytes) -> Ed25519PublicKey:
    """Inverse of :func:`public_bytes` for Ed25519."""
    return Ed25519PublicKey.from_public_bytes(raw)


@dataclass
class KeyRing:
    """A recipient's live X25519 keys, by key id; ``current`` is the one senders should use;
    ``retired`` the ids of keys it no longer holds (a blob naming one is an outdated sender's,
    not garbage). A service swaps in a new ring's contents with :meth:`replace` when its keys
    rotate, so every holder of the object sees them."""

    keys: dict[bytes, X25519PrivateKey] = field(default_factory=dict)
    current: bytes = b""
    retired: frozenset[bytes] = frozenset()

    @classmethod
    def of(cls, *private_keys: X25519PrivateKey) -> KeyRing:
        """A ring whose first key is current."""
        ring = cls()
        for private_key in private_keys:
            ring.add(private_key)
        ring.current = key_id(private_keys[0].public_key())
        return ring

    def add(self, private_key: X25519PrivateKey) -> bytes:
        """Add a live key; returns its id."""
        kid = key_id(private_key.public_key())
        self.keys[kid] = private_key
        return kid

    def public(self) -> X25519PublicKey:
        """The current public key."""
        return self.keys[self.current].public_key()

    def replace(self, other: KeyRing) -> None:
        """Take ``other``'s keys (a reader sees the old or the new key table, each whole)."""
        self.retired = other.retired | self.retired.difference(other.keys)
        self.keys = dict(other.keys)
        self.current = other.current


def seal(plaintext: bytes, public_key: X25519PublicKey, info: bytes) -> bytes:
    """HPKE base-mode one-shot seal, prefixed with the recipient key id."""
    return key_id(public_key) + SUITE.encrypt(plaintext, public_key, info)


def open_sealed(blob: bytes, ring: KeyRing, info: bytes) -> bytes:
    """Open a blob made by :func:`seal` with whichever live key it names.

    Raises:
        RetiredKeyError: it names a key the ring has retired.
        UnknownKeyError: it names a key the ring does not know.
        EnvelopeError: wrong ``info``, tampering or truncation.
    """
    if len(blob) < KEY_ID_SIZE + ENC_SIZE + TAG_SIZE:
        raise EnvelopeError(f"sealed blob too short ({len(blob)} bytes)")
    private_key = ring.keys.get(blob[:KEY_ID_SIZE])
    if private_key is None:
        if blob[:KEY_ID_SIZE] in ring.retired:
            raise RetiredKeyError(f"sealed to key {blob[:KEY_ID_SIZE].hex()}, now retired")
        raise UnknownKeyError(f"no live key with id {blob[:KEY_ID_SIZE].hex()}")
    try:
        return SUITE.decrypt(blob[KEY_ID_SIZE:], private_key, info)
    except (InvalidTag, ValueError) as error:
        raise EnvelopeError("ciphertext does not open (wrong context, key or tampered)") from error


def pad(data: bytes, size: int) -> bytes:
    """``uint16 length | data | zeros`` to exactly ``size`` bytes.

    Raises:
        ValueError: if ``data`` does not fit.
    """
    if len(data) + 2 > size or size > 0xFFFF:
        raise ValueError(f"{len(data)} bytes do not fit a padded size of {size}")
    return len(data).to_bytes(2, "big") + data + bytes(size - 2 - len(data))


def unpad(padded: bytes) -> bytes:
    """Inverse of :func:`pad`.

    Raises:
        EnvelopeError: if the length prefix or the padding is inconsistent.
    """
    if len(padded) < 2:
        raise EnvelopeError("padded plaintext shorter than its length prefix")
    length = int.from_bytes(padded[:2], "big")
    if length + 2 > len(padded) or any(padded[2 + length :]):
        raise EnvelopeError("inconsistent padding")
    return padded[2 : 2 + length]


@dataclass(frozen=True, slots=True)
class FragmentContext:
    """What a fragment is bound to: the channel, epoch and crowd of the contribution that
    carried it (the batch header names the same three, so the analyzer opens with them)."""

    channel_id: str
    epoch: int
    crowd_id: str

    def info(self) -> bytes:
        """HPKE ``info``: ``b"esa/2 inner " | u8 len + channel | u64 epoch | u8 len + crowd``.

        Raises:
            ValueError: a channel or crowd id over 255 bytes, an epoch outside uint64.
        """
        channel, crowd = self.channel_id.encode(), self.crowd_id.encode()
        if len(channel) > 255 or len(crowd) > 255 or not 0 <= self.epoch < 1 << 64:
            raise ValueError(f"no fragment context for {self!r}")
        return b"".join(
            (INNER_INFO, bytes([len(channel)]), channel, self.epoch.to_bytes(8, "big"),
             bytes([len(crowd)]), crowd)
        )  # fmt: skip


def outer_info(shuffler_id: str) -> bytes:
    """HPKE info binding a contribution to its shuffler."""
    return OUTER_INFO + shuffler_id.encode()


def inner_size(payload_size: int) -> int:
    """Length of every sealed fragment of a channel."""
    return KEY_ID_SIZE + ENC_SIZE + payload_size + TAG_SIZE


#: Bytes of a sealed fragment's HPKE ``enc`` (its sender's ephemeral X25519 public key) that
#: name it: 128 bits that no one can make another fragment's collide with, and that every
#: copy of the fragment repeats (:func:`seal_key`).
SEAL_KEY_SIZE = 16


def seal_key(blob: bytes) -> bytes:
    """What names a sealed fragment for counting it once: the first :data:`SEAL_KEY_SIZE`
    bytes of its ``enc``. Only a fragment that opens may be counted by it (the sealer alone
    can make a ciphertext that opens under its ``enc``)."""
    return blob[KEY_ID_SIZE : KEY_ID_SIZE + SEAL_KEY_SIZE]


def seal_fragment(
    fragment: bytes, context: FragmentContext, payload_size: int, analyzer: X25519PublicKey
) -> bytes:
    """Pad a fragment to the channel's payload size and seal it for the analyzer, bound to its
    channel, epoch and crowd."""
    return seal(pad(fragment, payload_size), analyzer, context.info())


def open_fragment(blob: bytes, context: FragmentContext | bytes, ring: KeyRing) -> bytes:
    """Open a fragment sealed for ``context`` (or its precomputed ``info``) and unpad it."""
    info = context if isinstance(context, bytes) else context.info()
    return unpad(open_sealed(blob, ring, info))


@dataclass(frozen=True)
class Contribution:
    """What a shuffler reads: routing metadata and sealed fragments it cannot open."""

    channel_id: str
    crowd_id: str
    epoch: int
    nonce: bytes
    fragments: tuple[bytes, ...]

    def encode(self) -> bytes:
        """The compact binary encoding (docs/protocol-notes.md, "Sealed envelopes")."""
        channel, crowd = self.channel_id.encode(), self.crowd_id.encode()
        if len(channel) > 255 or len(crowd) > 255 or len(self.nonce) != NONCE_SIZE:
            raise ValueError("channel_id and crowd_id must be <= 255 bytes, nonce 16 bytes")
        if not 0 <= self.epoch < 1 << 64 or len(self.fragments) > 0xFFFF:
            raise ValueError(
                f"epoch or fragment count out of range: {self.epoch}, {len(self.fragments)}"
            )
        parts = [MAGIC, bytes([len(channel)]), channel, bytes([len(crowd)]), crowd]
        parts.append(
            self.epoch.to_bytes(8, "big") + self.nonce + len(self.fragments).to_bytes(2, "big")
        )
        for fragment in self.fragments:
            parts.append(len(fragment).to_bytes(2, "big") + fragment)
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> Contribution:
        """Inverse of :meth:`encode`.

        Raises:
            EnvelopeError: naming what is malformed.
        """
        if data[:4] == OLD_MAGIC:
            raise WireVersionError(
                "wire version 1 contribution: this deployment takes version 2 (fragments bound "
                "to channel, epoch and crowd); update the client"
            )
        try:
            if data[:4] != MAGIC:
                raise EnvelopeError("not an ESA contribution (bad magic)")
            offset = 4
            channel, offset = _short_string(data, offset)
            crowd, offset = _short_string(data, offset)
            epoch = int.from_bytes(data[offset : offset + 8], "big")
            nonce = data[offset + 8 : offset + 8 + NONCE_SIZE]
            offset += 8 + NONCE_SIZE
            count = int.from_bytes(data[offset : offset + 2], "big")
            offset += 2
            fragments = []
            for _ in range(count):  # the ingest path: one struct read and one slice each
                start = offset + 2
                offset = start + _U16(data, offset)[0]
                fragments.append(data[start:offset])
            if offset > len(data):
                raise EnvelopeError("truncated fragment")
        except (IndexError, UnicodeDecodeError, struct.error) as error:
            raise EnvelopeError(f"malformed contribution: {error}") from error
        if offset != len(data) or len(nonce) != NONCE_SIZE:
            raise EnvelopeError("malformed contribution: trailing or missing bytes")
        return cls(channel, crowd, epoch, bytes(nonce), tuple(fragments))


def _short_string(data: bytes, offset: int) -> tuple[str, int]:
    length = data[offset]
    raw = data[offset + 1 : offset + 1 + length]
    if len(raw) != length:
        raise EnvelopeError("truncated string")
    return raw.decode(), offset + 1 + length


def new_nonce() -> bytes:
    """16 random bytes from the OS CSPRNG."""
    return os.urandom(NONCE_SIZE)


def seal_contribution(
    contribution: Contribution, shuffler_id: str, shuffler: X25519PublicKey
) -> bytes:
    """Seal a contribution for one shuffler."""
    return seal(contribution.encode(), shuffler, outer_info(shuffler_id))


def open_contribution(blob: bytes, shuffler_id: str, ring: KeyRing) -> Contribution:
    """Open and parse a contribution sealed for ``shuffler_id``."""
    return Contribution.decode(open_sealed(blob, ring, outer_info(shuffler_id)))


def sign(body: bytes, key: Ed25519PrivateKey) -> bytes:
    """Ed25519 signature of the exact bytes."""
    return key.sign(body)


def verify(body: bytes, signature: bytes, key: Ed25519PublicKey) -> bool:
    """True if ``signature`` is a valid Ed25519 signature of ``body``."""
    try:
        key.verify(signature, body)
    except InvalidSignature:
        return False
    return True


def write_private_key(path: Path, key: X25519PrivateKey | Ed25519PrivateKey) -> None:
    """Write an unencrypted PKCS#8 PEM with mode 0600 (created atomically, never widened).

    Raises:
        FileExistsError: if ``path`` exists (keys are never overwritten silently).
    """
    # Key files are the services' (a device keeps none): cryptography's serialization
    # package loads here, not with the module.
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    if not create_once(path, pem):
        raise FileExistsError(f"{path} exists: keys are never overwritten")


def _load_or_create(path: Path, generate: Callable[[], PrivateKey], kind: str) -> object:
    """Load the PEM key at ``path``, creating it (mode 0600) with ``generate`` on first use;
    when processes start together, the first key written is the one every process loads."""
    if not path.exists():
        with contextlib.suppress(FileExistsError):
            write_private_key(path, generate())
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, X25519PrivateKey | Ed25519PrivateKey):
        raise ValueError(f"{path} does not hold a {kind} key")
    return key


def load_or_create_x25519(path: Path) -> X25519PrivateKey:
    """The HPKE key at ``path``, created on first use.

    Raises:
        ValueError: if the file holds another kind of key.
    """
    key = _load_or_create(path, X25519PrivateKey.generate, "X25519")
    if not isinstance(key, X25519PrivateKey):
        raise ValueError(f"{path} does not hold an X25519 key")
    return key


def load_or_create_ed25519(path: Path) -> Ed25519PrivateKey:
    """The signing key at ``path``, created on first use.

    Raises:
        ValueError: if the file holds another kind of key.
    """
    key = _load_or_create(path, Ed25519PrivateKey.generate, "Ed25519")
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} does not hold an Ed25519 key")
    return key
