"""The signed collection config that clients fetch from the analyzer (PROTOCOL.md).

``{"config": {...}, "signature": base64 Ed25519}`` where the signature covers the canonical JSON
of ``config`` (sorted keys, no whitespace). The config (:class:`common.wire.CollectionConfig`)
lists the analyzer's live HPKE keys (the current one first), its signing key, the shufflers (URL,
HPKE key, signing key) and the channels, with an issue and an expiry time. Clients pin the
analyzer's signing key and refuse a config that is unsigned, signed by another key, tampered
with, expired or malformed.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from common.envelope import verify
from common.wire import CollectionConfig, SignedConfig


class CollectionConfigError(ValueError):
    """A collection config that is unsigned, mis-signed, tampered with, expired or malformed."""


def canonical(config: Mapping[str, Any]) -> bytes:
    """The exact bytes that are signed."""
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def sign_config(config: CollectionConfig, key: Ed25519PrivateKey) -> SignedConfig:
    """The signed document served at ``GET /v1/config``."""
    body = config.model_dump(mode="json")
    return SignedConfig(config=body, signature=base64.b64encode(key.sign(canonical(body))).decode())


def verify_config(
    document: Mapping[str, Any] | SignedConfig, key: Ed25519PublicKey, now: float
) -> CollectionConfig:
    """The config inside a signed document, if the signature holds and it has not expired.

    Raises:
        CollectionConfigError: naming what is wrong.
    """
    if isinstance(document, SignedConfig):
        document = document.model_dump()
    config, signature = document.get("config"), document.get("signature")
    if not isinstance(config, dict) or not isinstance(signature, str):
        raise CollectionConfigError("collection config is not signed (missing config or signature)")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError) as error:
        raise CollectionConfigError("collection config signature is not base64") from error
    if not verify(canonical(config), raw, key):
        raise CollectionConfigError(
            "collection config signature does not verify (wrong key or tampered)"
        )
    try:
        parsed = CollectionConfig.model_validate(config)
    except ValidationError as error:
        raise CollectionConfigError(f"collection config is malformed: {error}") from error
    if now > parsed.expires_at:
        raise CollectionConfigError(f"collection config expired at {parsed.expires_at}")
    return parsed
