"""How long a request may take to arrive: the deadlines :mod:`runtime.server` holds every
request to, and the settings both services read them from.

A request head must arrive whole within ``head_timeout_seconds`` of its first byte (or of the
connection, for one that sends nothing); a body within ``body_timeout_seconds`` of its head, and
no slower than ``body_min_rate_bytes`` per second once ``body_rate_grace_seconds`` have passed
(a sender trickling bytes is cut off long before the whole deadline). Time the server itself
holds a body back (reading paused until the application asks for more, or an ``Expect:
100-continue`` not answered yet) does not count. A request over a deadline is answered ``408``
(``head_timeout`` or ``body_timeout``) and its connection closed, so nothing another party
sends can hold a connection, or what the application reserved for it, for longer.

A client that reads none of its answers for ``body_timeout_seconds`` is dropped too
(:mod:`runtime.server`).

Why: docs/protocol-notes.md, "Batch intake: pre-authentication and deadlines" (every read of
another party's bytes has a whole-request deadline); docs/architecture.md, "Runtime: HAProxy and
the server".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, Field, model_validator

#: Default whole-head deadline: a head is at most 32 KiB (:data:`runtime.server.HEAD_LIMIT`).
HEAD_TIMEOUT = 10.0
#: Default whole-body deadline: the analyzer's largest part (4.95 MB) at 100 KB/s is 50 s.
BODY_TIMEOUT = 60.0
#: Default lowest transfer rate of a body (bytes per second) once the grace has passed.
BODY_MIN_RATE = 1024.0
#: Default seconds a body may start slowly before its rate is checked (a client's first
#: round trips, TCP slow start).
BODY_RATE_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class ReadDeadlines:
    """The deadlines of one server (defaults: the module's constants)."""

    head_seconds: float = HEAD_TIMEOUT
    body_seconds: float = BODY_TIMEOUT
    body_min_rate: float = BODY_MIN_RATE
    body_rate_grace: float = BODY_RATE_GRACE

    def body_late(self, elapsed: float, received: int) -> str | None:
        """Why a body that has taken ``elapsed`` seconds (not counting time the server held
        it back) and brought ``received`` bytes is cut off now, or None while it may go on:
        over the whole deadline, or fewer bytes than the minimum rate owes after the grace."""
        if elapsed >= self.body_seconds:
            return f"the request body did not arrive within {self.body_seconds:g} s"
        owed = self.body_min_rate * (elapsed - self.body_rate_grace)
        if owed > 0 and received < owed:
            return (
                f"the request body arrived slower than {self.body_min_rate:g} bytes/s "
                f"({received} bytes in {elapsed:.1f} s)"
            )
        return None


def _ignore(_: str) -> None:
    """Count nothing (a server whose application keeps no counters)."""


@dataclass(frozen=True, slots=True)
class ReadGuard:
    """What an application gives the server as ``app.state.read_guard``: its deadlines, and
    where to count a request cut off (the event ``requests_head_timeout`` or
    ``requests_body_timeout``) or a connection dropped for not reading its answers
    (``requests_write_timeout``)."""

    deadlines: ReadDeadlines = ReadDeadlines()
    count: Callable[[str], None] = field(default=_ignore)


class DeadlineSettings(BaseModel):
    """The deadline settings of a service (``ESA_<SERVICE>_HEAD_TIMEOUT_SECONDS`` and so on);
    documented in docs/operations.md."""

    #: Seconds a request head may take to arrive whole (from its first byte, or from the
    #: connection for one that sends nothing).
    head_timeout_seconds: float = Field(HEAD_TIMEOUT, gt=0, le=3600)
    #: Seconds a request body may take to arrive whole after its head.
    body_timeout_seconds: float = Field(BODY_TIMEOUT, gt=0, le=3600)
    #: Slowest a body may arrive, in bytes per second, once ``body_rate_grace_seconds`` have
    #: passed (0: only the whole deadline).
    body_min_rate_bytes: float = Field(BODY_MIN_RATE, ge=0)
    #: Seconds a body may arrive slowly before its rate is checked.
    body_rate_grace_seconds: float = Field(BODY_RATE_GRACE, ge=0)

    @model_validator(mode="after")
    def _grace_within_deadline(self) -> DeadlineSettings:
        grace, whole = self.body_rate_grace_seconds, self.body_timeout_seconds
        if self.body_min_rate_bytes > 0 and grace >= whole:
            raise ValueError(
                f"body_rate_grace_seconds ({self.body_rate_grace_seconds:g}) must be below "
                f"body_timeout_seconds ({self.body_timeout_seconds:g}), or the minimum rate "
                "(body_min_rate_bytes) is never checked; set body_min_rate_bytes=0 to mean that"
            )
        return self

    def read_deadlines(self) -> ReadDeadlines:
        """These settings as the server's deadlines."""
        return ReadDeadlines(
            head_seconds=self.head_timeout_seconds,
            body_seconds=self.body_timeout_seconds,
            body_min_rate=self.body_min_rate_bytes,
            body_rate_grace=self.body_rate_grace_seconds,
        )
