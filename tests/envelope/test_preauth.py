"""The shuffler's signed head of a batch part (common/preauth.py): it verifies only for the
shuffler, body length, digest and time it names, within its window, with its own key."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.preauth import PREAUTH_WINDOW_SECONDS, PreauthError, parse_preauth, preauth_header

KEY = Ed25519PrivateKey.generate()
NOW = 1_800_000_000.0
BODY = b'{"batch_id": "x"}'


def test_a_head_verifies_for_what_it_names_only() -> None:
    head = parse_preauth(preauth_header("shuffler-1", BODY, KEY, NOW))
    head.check("shuffler-1", KEY.public_key(), NOW + PREAUTH_WINDOW_SECONDS)
    head.check_body(BODY)
    with pytest.raises(PreauthError, match="does not verify"):
        head.check("shuffler-2", KEY.public_key(), NOW)  # another shuffler's id
    with pytest.raises(PreauthError, match="does not verify"):
        head.check("shuffler-1", Ed25519PrivateKey.generate().public_key(), NOW)
    for late in (NOW + PREAUTH_WINDOW_SECONDS + 1, NOW - PREAUTH_WINDOW_SECONDS - 1):
        with pytest.raises(PreauthError, match="from this analyzer's clock"):
            head.check("shuffler-1", KEY.public_key(), late)
    for other in (BODY + b" ", BODY[:-1] + b"!"):  # another length, another digest
        with pytest.raises(PreauthError, match="not the one"):
            head.check_body(other)


def test_a_changed_field_no_longer_verifies() -> None:
    stamp, length, digest, signature = preauth_header("shuffler-1", BODY, KEY, NOW).split(".")
    changed = [
        f"{int(stamp) + 1}.{length}.{digest}.{signature}",
        f"{stamp}.{int(length) + 1}.{digest}.{signature}",
        f"{stamp}.{length}.{'0' * 64}.{signature}",
    ]
    for value in changed:
        with pytest.raises(PreauthError, match="does not verify"):
            parse_preauth(value).check("shuffler-1", KEY.public_key(), NOW)


@pytest.mark.parametrize(
    "value",
    [None, "", "1.2.3", "1.2." + "0" * 64 + ".c2ln", "x.2." + "0" * 64 + "." + "A" * 86 + "==",
     "1.2." + "g" * 64 + "." + "A" * 86 + "==", "1" * 300],
)  # fmt: skip
def test_a_malformed_head_is_refused_by_name(value: str | None) -> None:
    with pytest.raises(PreauthError, match="ESA-Preauth"):
        parse_preauth(value)
