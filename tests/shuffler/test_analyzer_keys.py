"""A shuffler that follows the analyzer's config refuses a contribution whose fragments are
sealed to an analyzer HPKE key the config no longer lists (409 ``config_outdated``: the device
fetches the config again), never one sealed to a key it has not seen yet (a config newer than
the one it follows). shuffler/policies.py ``AnalyzerKeyIds``, shuffler/intake.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from common.wire import HpkeKey
from shuffler.errors import ConfigOutdatedError
from shuffler.policies import AnalyzerKeyIds

from .factory import make_service, pending

#: The test contributions' fragments are ``bytes([i]) * 72``: fragment i names key id i…i.
FIRST, SECOND = bytes([0]) * 8, bytes([1]) * 8


def _key(key_id: bytes) -> HpkeKey:
    return HpkeKey(key_id=key_id.hex(), public_key="unused-here")


def test_a_key_seen_then_no_longer_listed_is_retired_and_a_replay_does_not_revive_it() -> None:
    keys = AnalyzerKeyIds()
    keys.adopt([_key(FIRST)], issued_at=100)
    assert not keys.retired(FIRST) and not keys.retired(SECOND)
    keys.adopt([_key(SECOND), _key(FIRST)], issued_at=200)  # rotated: both open
    assert not keys.retired(FIRST)
    keys.adopt([_key(SECOND)], issued_at=300)  # the first one retired
    assert keys.retired(FIRST) and not keys.retired(SECOND)
    keys.adopt([_key(SECOND), _key(FIRST)], issued_at=200)  # an older config replayed
    assert keys.retired(FIRST)


def test_fragments_sealed_to_a_retired_analyzer_key_are_refused_as_outdated(
    database_url: str, tmp_path: Path
) -> None:
    service, clock = make_service(database_url, tmp_path)
    token, epoch = service.tokens.issue(), clock.epoch
    keys = AnalyzerKeyIds()
    service.intake.hooks = replace(service.intake.hooks, analyzer_key_retired=keys.retired)
    keys.adopt([_key(FIRST)], issued_at=100)
    assert pending(service, token, epoch, fragments=1)  # sealed to the current key
    keys.adopt([_key(SECOND)], issued_at=200)
    with pytest.raises(ConfigOutdatedError, match=f"analyzer's key {FIRST.hex()}, now retired"):
        pending(service, token, epoch, fragments=1)
    with pytest.raises(ConfigOutdatedError):  # one fragment of two is enough
        pending(service, token, epoch, fragments=2)
    keys.adopt([_key(bytes([2]) * 8)], issued_at=300)  # the second retired too
    assert pending(service, token, epoch, fragments=3, tag=0x03030303)  # never seen: taken
