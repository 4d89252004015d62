"""The pre-authentication header of a batch part (``ESA-Preauth``): the sending shuffler's
Ed25519 signature over its id, the body's length and SHA-256, and a timestamp, checked by the
analyzer from the request head alone, before it gives the request an intake slot.

The value is ``<timestamp>.<length>.<sha256 hex>.<base64 signature>``; the signed message is
``b"esa-preauth-v1\\0" + shuffler_id + b"\\0" + length + b"\\0" + sha256 hex + b"\\0" +
timestamp`` (decimal ASCII). A header is good for :data:`PREAUTH_WINDOW_SECONDS` either side
of the analyzer's clock (the parties' clock skew), and only for the body it names: the analyzer
checks the body's length and digest after reading it. Why and what it leaves:
docs/protocol-notes.md, "Batch intake: pre-authentication and deadlines".
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common.collection import MAX_CLOCK_SKEW_SECONDS
from common.envelope import sign, verify

#: The header's name.
PREAUTH_HEADER = "ESA-Preauth"
#: Seconds a header's timestamp may be away from the analyzer's clock, either way.
PREAUTH_WINDOW_SECONDS = MAX_CLOCK_SKEW_SECONDS
#: Domain separation of the signed message (no other signature of a shuffler's key verifies).
PREAUTH_CONTEXT = b"esa-preauth-v1\0"
#: Bytes of an Ed25519 signature (RFC 8032, §5.1.6).
_SIGNATURE_BYTES = 64
#: The header's form (what :func:`parse_preauth` accepts, as the OpenAPI states it).
PREAUTH_PATTERN = r"^[0-9]{1,20}\.[0-9]{1,20}\.[0-9a-fA-F]{64}\.[A-Za-z0-9+/]{86}==$"


class PreauthError(ValueError):
    """An ``ESA-Preauth`` header that is missing, malformed, out of its window, not signed by
    the shuffler, or that does not name the body that came."""


@dataclass(frozen=True, slots=True)
class Preauth:
    """A parsed ``ESA-Preauth`` header."""

    timestamp: int
    length: int
    digest: str
    signature: bytes

    def message(self, shuffler_id: str) -> bytes:
        """The bytes the shuffler signs."""
        fields = (shuffler_id, str(self.length), self.digest, str(self.timestamp))
        return PREAUTH_CONTEXT + b"\0".join(f.encode() for f in fields)

    def check(self, shuffler_id: str, key: Ed25519PublicKey, now: float) -> None:
        """Refuse a header out of its window or not signed by ``key`` for ``shuffler_id``.

        Raises:
            PreauthError: naming which.
        """
        if abs(self.timestamp - now) > PREAUTH_WINDOW_SECONDS:
            raise PreauthError(
                f"ESA-Preauth timestamp {self.timestamp} is more than "
                f"{PREAUTH_WINDOW_SECONDS} s from this analyzer's clock ({int(now)})"
            )
        if not verify(self.message(shuffler_id), self.signature, key):
            raise PreauthError("ESA-Preauth does not verify for this shuffler")

    def check_body(self, body: bytes) -> None:
        """Refuse a body other than the one the header names.

        Raises:
            PreauthError: another length or digest.
        """
        if len(body) != self.length or hashlib.sha256(body).hexdigest() != self.digest:
            raise PreauthError("the body is not the one ESA-Preauth names (length or SHA-256)")


def preauth_header(shuffler_id: str, body: bytes, key: Ed25519PrivateKey, now: float) -> str:
    """The ``ESA-Preauth`` value a shuffler sends with ``body`` at ``now``."""
    unsigned = Preauth(int(now), len(body), hashlib.sha256(body).hexdigest(), b"")
    signature = sign(unsigned.message(shuffler_id), key)
    encoded = base64.b64encode(signature).decode()
    return f"{unsigned.timestamp}.{unsigned.length}.{unsigned.digest}.{encoded}"


def parse_preauth(value: str | None) -> Preauth:
    """An ``ESA-Preauth`` header value, parsed.

    Raises:
        PreauthError: missing, or not ``<timestamp>.<length>.<sha256 hex>.<base64 signature>``
            (:data:`PREAUTH_PATTERN`).
    """
    if not value:
        raise PreauthError(f"{PREAUTH_HEADER} header required (the shuffler's signed head)")
    if re.fullmatch(PREAUTH_PATTERN, value.strip()) is None:
        raise PreauthError(
            f"{PREAUTH_HEADER} must be <timestamp>.<length>.<sha256 hex>.<base64 signature of "
            f"{_SIGNATURE_BYTES} bytes>"
        )
    stamp, length, digest, signature = value.strip().split(".")
    return Preauth(int(stamp), int(length), digest.lower(), base64.b64decode(signature))
