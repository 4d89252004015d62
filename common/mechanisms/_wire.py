"""Inner-plaintext framing shared by every mechanism (docs/protocol.md, "Inner plaintext").

``version (1 byte) | mechanism code (1 byte) | mechanism payload (fixed length per mechanism)``.
Nothing else: no client id, timestamp or counter. Integers are big-endian.
"""

from __future__ import annotations

WIRE_VERSION = 1


class FragmentError(ValueError):
    """A fragment that does not parse for its channel's mechanism (counted as chaff)."""


def frame(code: int, payload: bytes) -> bytes:
    """Prefix a mechanism payload with the version and mechanism code."""
    return bytes((WIRE_VERSION, code)) + payload


def unframe(code: int, payload_size: int, fragment: bytes) -> bytes:
    """Check version, code and length; return the mechanism payload.

    Raises:
        FragmentError: naming what is wrong.
    """
    if len(fragment) != 2 + payload_size:
        raise FragmentError(f"fragment must be {2 + payload_size} bytes, got {len(fragment)}")
    if fragment[0] != WIRE_VERSION:
        raise FragmentError(f"unsupported wire version {fragment[0]}, expected {WIRE_VERSION}")
    if fragment[1] != code:
        raise FragmentError(f"mechanism code {fragment[1]} does not match the channel's {code}")
    return fragment[2:]
