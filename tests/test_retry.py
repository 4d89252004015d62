"""The shared retry policy (common.retry): backoff with jitter, retryable statuses, Retry-After."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from common.randomness import SeededSource
from common.retry import Backoff, retry_after_seconds, retryable_status


class Fixed:
    """A source whose ``random()`` is always ``value``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value

    def randbelow(self, upper: int) -> int:
        return 0


@pytest.mark.parametrize("attempt", [0, 1, 2, 5, 10, 100, 10_000])
def test_delay_is_capped_exponential_with_jitter_in_half_to_one_and_a_half(attempt: int) -> None:
    backoff = Backoff(base=0.5, cap=60.0)
    ceiling = min(60.0, 0.5 * 2.0 ** min(attempt, 62))
    assert backoff.delay(attempt, Fixed(0.0)) == pytest.approx(0.5 * ceiling)
    assert backoff.delay(attempt, Fixed(0.999999)) == pytest.approx(1.5 * ceiling, rel=1e-5)
    rng = SeededSource(attempt)
    delays = [backoff.delay(attempt, rng) for _ in range(1_000)]
    assert 0.5 * ceiling <= min(delays) and max(delays) < 1.5 * ceiling
    assert len(set(delays)) > 900  # jittered: retries that failed together spread out


def test_delay_grows_until_the_cap() -> None:
    backoff = Backoff(base=1.0, cap=8.0)
    assert [backoff.delay(a, Fixed(0.5)) for a in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="base=0"):
        Backoff(base=0, cap=1)
    with pytest.raises(ValueError, match=r"cap=0\.1"):
        Backoff(base=1, cap=0.1)
    with pytest.raises(ValueError, match="attempt=-1"):
        Backoff().delay(-1, Fixed(0.0))


def test_retryable_statuses() -> None:
    assert [s for s in range(100, 600) if retryable_status(s)] == [408, 425, 429, *range(500, 600)]


def test_retry_after_in_both_forms() -> None:
    assert retry_after_seconds({}) is None
    assert retry_after_seconds({"Retry-After": "120"}) == 120.0
    assert retry_after_seconds({"retry-after": " 7 "}) == 7.0
    assert retry_after_seconds({"Retry-After": "soon"}) is None
    assert retry_after_seconds({"Retry-After": "-3"}) is None
    when = format_datetime(datetime.fromtimestamp(1_000_090, tz=UTC), usegmt=True)
    assert retry_after_seconds({"Retry-After": when}, now=lambda: 1_000_000.0) == 90.0
    assert retry_after_seconds({"Retry-After": when}, now=lambda: 2_000_000.0) == 0.0
