"""Schemathesis hooks for the shuffler fuzz run (:mod:`tests.shuffler.test_fuzz`), loaded by the
``schemathesis`` CLI through ``SCHEMATHESIS_HOOKS``; the test passes the instance through
``ESA_FUZZ_*`` environment variables.

* :class:`Credentials`: the admin (and metrics) token for admin routes and ``/metrics``, a fresh
  genuine client token for every contribution (now and then one used before, so the quota is
  hit). Credentials given this way are *explicit* to schemathesis, so its ``ignored_auth`` check
  also sends each secured operation without them and with wrong ones and expects a 401.
* ``flatmap_body``: besides schemathesis' own bytes, ``POST /v1/contributions`` gets
  contributions genuinely sealed to this shuffler (:func:`sealed`): acceptable ones, and ones
  wrong in exactly one way checked after decryption (wire version 1's magic, channel, crowd,
  epoch, too many or too few fragments, replayed nonce) — the validation behind HPKE is fuzzed
  too.
* ``before_generate_case``: every case also carries an unknown ``X-Fuzz`` header and ``fuzz``
  query parameter (ignored by every route), so operations without inputs are fuzzed with as
  many distinct requests as the others.
* ``after_call``: one line per answer (operation, method sent, phase, status, error code) in
  ``ESA_FUZZ_TALLY`` for the test's counts.
"""

from __future__ import annotations

import base64
import json
import os
import time
from typing import Any

import schemathesis
from hypothesis import strategies as st

from common.envelope import (
    OLD_MAGIC,
    Contribution,
    load_x25519_public,
    new_nonce,
    outer_info,
    seal,
    seal_contribution,
)
from shuffler.intake import TokenAuthority

CONTRIBUTIONS = "/v1/contributions"
ADMIN_TOKEN = os.environ.get("ESA_FUZZ_ADMIN_TOKEN", "")
SHUFFLER_ID = os.environ.get("ESA_FUZZ_SHUFFLER_ID", "shuffler-1")
CHANNELS: list[dict[str, Any]] = json.loads(os.environ.get("ESA_FUZZ_CHANNELS", "[]"))
TALLY = os.environ.get("ESA_FUZZ_TALLY", "")
TOKENS = TokenAuthority(os.environ.get("ESA_FUZZ_TOKEN_SECRET", "").encode())
#: Every this many client tokens, the previous one again (its second contribution: quota).
REUSE_EVERY = 7


def _shuffler_key() -> Any:
    raw = os.environ.get("ESA_FUZZ_SHUFFLER_KEY")
    return load_x25519_public(base64.b64decode(raw)) if raw else None


KEY = _shuffler_key()


@schemathesis.auth(refresh_interval=None)
class Credentials:
    """Explicit credentials per operation (see the module docstring)."""

    def __init__(self) -> None:
        self.issued = 0
        self.last = TOKENS.issue()

    def get(self, case: Any, context: Any) -> str | None:
        path = case.operation.path
        if path.startswith("/v1/admin/") or path == "/metrics":
            return ADMIN_TOKEN
        if path != CONTRIBUTIONS or case.method.upper() != "POST":  # not its preflight
            return None
        self.issued += 1
        if self.issued % REUSE_EVERY:
            self.last = TOKENS.issue()
        return self.last

    def set(self, case: Any, data: str, context: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


FLAWS = (
    "none", "channel", "none", "version", "none", "crowd", "none", "few", "none", "epoch",
    "none", "many", "none", "replay",
)  # fmt: skip


@st.composite
def sealed(draw: st.DrawFn) -> bytes:
    """A contribution sealed to this shuffler: acceptable half of the time, else wrong in one
    way."""
    flaw = FLAWS[draw(st.integers(0, len(FLAWS) - 1))]
    fewest = [c for c in CHANNELS if c.get("min_fragments", 0) > 0]
    channel = draw(st.sampled_from(fewest if flaw == "few" else CHANNELS))
    channel_id, epoch = channel["id"], int(time.time() // channel["epoch_seconds"])
    crowds = channel.get("crowds", [""])
    crowd = draw(st.sampled_from(crowds))
    least = channel.get("min_fragments", 0)
    count = draw(st.integers(least, channel["max_fragments"]))
    if flaw == "channel":
        channel_id = draw(st.text(min_size=1, max_size=30).filter(_not_a_channel))
    elif flaw == "crowd":
        crowd = draw(st.text(min_size=1, max_size=30).filter(lambda c: c not in crowds))
    elif flaw == "epoch":
        epoch = draw(st.sampled_from([0, epoch - 2, epoch + 1, 2**53, 2**64 - 1]))
    elif flaw == "many":
        count = channel["max_fragments"] + draw(st.integers(1, 3))
    elif flaw == "few":
        count = draw(st.integers(0, least - 1))
    fragments = tuple(draw(st.binary(max_size=80)) for _ in range(count))
    nonce = bytes(16) if flaw == "replay" else new_nonce()
    contribution = Contribution(
        channel_id=channel_id, crowd_id=crowd, epoch=epoch, nonce=nonce, fragments=fragments
    )
    try:
        if flaw == "version":  # what a wire version 1 client sends: refused by name
            return seal(OLD_MAGIC + contribution.encode()[4:], KEY, outer_info(SHUFFLER_ID))
        return seal_contribution(contribution, SHUFFLER_ID, KEY)
    except ValueError:  # a channel id over 255 UTF-8 bytes does not encode: what the SDK sends
        return draw(st.binary(min_size=1, max_size=200))


def _not_a_channel(channel_id: str) -> bool:
    return channel_id not in {c["id"] for c in CHANNELS}


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> Any:
    operation = context.operation
    if operation is None or (operation.method.upper(), operation.path) != ("POST", CONTRIBUTIONS):
        return st.just(body)
    return st.one_of(st.just(body), sealed())


NOISE = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=24)


@schemathesis.hook
def before_generate_case(context: Any, strategy: Any) -> Any:
    return st.tuples(strategy, NOISE, NOISE).map(_with_noise)


def _with_noise(drawn: tuple[Any, str, str]) -> Any:
    case, header, query = drawn
    case.headers = {**(case.headers or {}), "X-Fuzz": header}
    case.query = {**(case.query or {}), "fuzz": query}
    return case


@schemathesis.hook
def after_call(context: Any, case: Any, response: Any) -> None:
    if not TALLY:
        return
    code = ""
    if response.status_code >= 400:
        try:
            code = str(json.loads(response.content).get("error", ""))
        except (ValueError, AttributeError):
            code = "<not JSON>"
    phase = case.meta.phase.name.value if case.meta is not None else "other"
    entry = [case.operation.label, case.method.upper(), phase, response.status_code, code]
    entry.append("authorization" in {k.lower() for k in (case.headers or {})})
    entry.append(len(case.body) if isinstance(case.body, bytes) else -1)
    with open(TALLY, "a") as tally:
        tally.write(json.dumps(entry) + "\n")
