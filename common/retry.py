"""One retry policy for everything of ours that sends over HTTP: the device SDK's outbox and the
shuffler's forwarder.

* :class:`Backoff`: capped exponential backoff with multiplicative jitter in [0.5, 1.5), so
  devices or shufflers that failed together do not retry together.
* :func:`retryable_status`: which answers can heal by waiting (408, 425, 429 and 5xx); every
  other 4xx is permanent — the same request will be refused again.
* :func:`retry_after_seconds`: the server's own ``Retry-After`` (RFC 9110 §10.2.3), either
  form, when it sent one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import time

from common.randomness import RandomSource

#: Statuses that mean "try again later" (RFC 9110 §15.5.9, RFC 8470 §5.2, RFC 6585 §4).
RETRYABLE_4XX = frozenset({408, 425, 429})
#: Exponents above this already exceed any sensible cap; keeps ``2**attempt`` a small float.
MAX_EXPONENT = 62


@dataclass(frozen=True, slots=True)
class Backoff:
    """``min(cap, base * 2**attempt) * U[0.5, 1.5)`` seconds before retry number ``attempt + 1``.

    Args:
        base: Delay scale for the first retry, in seconds (> 0).
        cap: Largest delay before jitter, in seconds (>= base).
    """

    base: float = 0.5
    cap: float = 60.0

    def __post_init__(self) -> None:
        if not self.base > 0:
            raise ValueError(f"base must be > 0, got base={self.base}")
        if not self.cap >= self.base:
            raise ValueError(f"cap must be >= base, got cap={self.cap}, base={self.base}")

    def delay(self, attempt: int, rng: RandomSource) -> float:
        """Seconds to wait after ``attempt`` failed attempts (0 for the first failure).

        Raises:
            ValueError: if ``attempt`` is negative.
        """
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got attempt={attempt}")
        ceiling = min(self.cap, self.base * 2.0 ** min(attempt, MAX_EXPONENT))
        return ceiling * (0.5 + rng.random())


def retryable_status(status: int) -> bool:
    """True when an HTTP status can heal by retrying later (408, 425, 429, 5xx)."""
    return status in RETRYABLE_4XX or 500 <= status <= 599


def retry_after_seconds(
    headers: Mapping[str, str], now: Callable[[], float] = time
) -> float | None:
    """Seconds the server asked to wait (``Retry-After``), or None when absent or unreadable.

    Accepts delta-seconds (``"120"``) and an HTTP date; a date in the past gives 0.
    """
    value = headers.get("Retry-After") or headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    from email.utils import parsedate_to_datetime  # the email package, for dates alone

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, math.ceil(when.timestamp() - now()))
