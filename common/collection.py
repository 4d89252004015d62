"""The signed collection config that clients fetch from the analyzer (PROTOCOL.md).

``{"config": {...}, "signature": base64 Ed25519}`` where the signature covers the canonical JSON
of ``config`` (sorted keys, no whitespace). The config lists the analyzer's live HPKE keys (the
current one first), its signing key, the shufflers (URL, HPKE key, signing key) and the channels,
with an issue and an expiry time. Clients pin the analyzer's signing key and refuse a config that
is unsigned, signed by another key, tampered with, or expired.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common.envelope import verify


class ConfigError(ValueError):
    """A collection config that is unsigned, mis-signed, tampered with, expired or malformed."""


def canonical(config: dict[str, Any]) -> bytes:
    """The exact bytes that are signed."""
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def sign_config(config: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """The signed document served at ``GET /v1/config``."""
    return {"config": config, "signature": base64.b64encode(key.sign(canonical(config))).decode()}


def verify_config(document: dict[str, Any], key: Ed25519PublicKey, now: float) -> dict[str, Any]:
    """The config inside a signed document, if the signature holds and it has not expired.

    Raises:
        ConfigError: naming what is wrong.
    """
    config, signature = document.get("config"), document.get("signature")
    if not isinstance(config, dict) or not isinstance(signature, str):
        raise ConfigError("collection config is not signed (missing config or signature)")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ConfigError("collection config signature is not base64") from error
    if not verify(canonical(config), raw, key):
        raise ConfigError("collection config signature does not verify (wrong key or tampered)")
    expires = config.get("expires_at")
    if not isinstance(expires, int | float) or now > expires:
        raise ConfigError(f"collection config expired at {expires}")
    return config
