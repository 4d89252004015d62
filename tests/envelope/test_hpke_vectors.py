"""Our HPKE suite against the RFC 9180 test vectors shipped in ``cryptography-vectors``.

The library's one-shot API hides the ephemeral key and the AAD, so the vectors cannot be fed to
it directly. Instead this test carries an independent, test-only reference of RFC 9180 base
mode (DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM; §4.1, §5.1, §5.2) and checks that
(1) the reference reproduces the vector's shared secret, key, nonce and first ciphertext,
(2) ciphertexts from the library's ``encrypt`` open with the reference, and (3) ciphertexts the
reference makes with the vector's ephemeral key open with the library's ``decrypt``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import cryptography_vectors
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from common.envelope import SUITE

KEM_SUITE = b"KEM" + (0x20).to_bytes(2, "big")
HPKE_SUITE = b"HPKE" + (0x20).to_bytes(2, "big") + (1).to_bytes(2, "big") + (1).to_bytes(2, "big")


def _extract(salt: bytes, ikm: bytes) -> bytes:
    return hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()


def _expand(prk: bytes, info: bytes, length: int) -> bytes:
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def labeled_extract(suite: bytes, salt: bytes, label: bytes, ikm: bytes) -> bytes:
    return _extract(salt, b"HPKE-v1" + suite + label + ikm)


def labeled_expand(suite: bytes, prk: bytes, label: bytes, info: bytes, length: int) -> bytes:
    return _expand(prk, length.to_bytes(2, "big") + b"HPKE-v1" + suite + label + info, length)


def shared_secret(dh: bytes, enc: bytes, pk_r: bytes) -> bytes:
    eae_prk = labeled_extract(KEM_SUITE, b"", b"eae_prk", dh)
    return labeled_expand(KEM_SUITE, eae_prk, b"shared_secret", enc + pk_r, 32)


def key_schedule(secret_in: bytes, info: bytes) -> tuple[bytes, bytes]:
    psk_id_hash = labeled_extract(HPKE_SUITE, b"", b"psk_id_hash", b"")
    info_hash = labeled_extract(HPKE_SUITE, b"", b"info_hash", info)
    context = b"\x00" + psk_id_hash + info_hash
    secret = labeled_extract(HPKE_SUITE, secret_in, b"secret", b"")
    key = labeled_expand(HPKE_SUITE, secret, b"key", context, 16)
    nonce = labeled_expand(HPKE_SUITE, secret, b"base_nonce", context, 12)
    return key, nonce


def _raw(public: X25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@pytest.fixture(scope="module")
def vector() -> dict[str, object]:
    path = Path(cryptography_vectors.__file__).parent / "HPKE" / "test-vectors.json"
    vectors = json.loads(path.read_text())
    matches = [
        v for v in vectors if (v["mode"], v["kem_id"], v["kdf_id"], v["aead_id"]) == (0, 0x20, 1, 1)
    ]
    assert len(matches) == 1
    return matches[0]


def test_reference_reproduces_the_rfc_vector(vector: dict[str, str]) -> None:
    sk_r = X25519PrivateKey.from_private_bytes(bytes.fromhex(vector["skRm"]))
    enc, pk_r = bytes.fromhex(vector["enc"]), bytes.fromhex(vector["pkRm"])
    assert _raw(sk_r.public_key()) == pk_r
    secret = shared_secret(sk_r.exchange(X25519PublicKey.from_public_bytes(enc)), enc, pk_r)
    assert secret.hex() == vector["shared_secret"]
    key, nonce = key_schedule(secret, bytes.fromhex(vector["info"]))
    assert key.hex() == vector["key"] and nonce.hex() == vector["base_nonce"]
    first = vector["encryptions"][0]  # type: ignore[index]
    plaintext = AESGCM(key).decrypt(nonce, bytes.fromhex(first["ct"]), bytes.fromhex(first["aad"]))
    assert plaintext.hex() == first["pt"]


def test_library_ciphertexts_open_with_the_reference(vector: dict[str, str]) -> None:
    sk_r = X25519PrivateKey.from_private_bytes(bytes.fromhex(vector["skRm"]))
    info, message = bytes.fromhex(vector["info"]), b"fragment bytes" * 3
    blob = SUITE.encrypt(message, sk_r.public_key(), info)
    enc, ciphertext = blob[:32], blob[32:]
    secret = shared_secret(
        sk_r.exchange(X25519PublicKey.from_public_bytes(enc)), enc, _raw(sk_r.public_key())
    )
    key, nonce = key_schedule(secret, info)
    assert AESGCM(key).decrypt(nonce, ciphertext, b"") == message


def test_reference_ciphertexts_open_with_the_library(vector: dict[str, str]) -> None:
    sk_r = X25519PrivateKey.from_private_bytes(bytes.fromhex(vector["skRm"]))
    sk_e = X25519PrivateKey.from_private_bytes(bytes.fromhex(vector["skEm"]))
    pk_r, enc = _raw(sk_r.public_key()), _raw(sk_e.public_key())
    assert enc.hex() == vector["enc"]
    secret = shared_secret(sk_e.exchange(sk_r.public_key()), enc, pk_r)
    key, nonce = key_schedule(secret, bytes.fromhex(vector["info"]))
    ciphertext = AESGCM(key).encrypt(nonce, b"hello shuffler", b"")
    assert SUITE.decrypt(enc + ciphertext, sk_r, bytes.fromhex(vector["info"])) == b"hello shuffler"
