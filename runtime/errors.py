"""Domain errors: what a service core refuses, with a stable code and no HTTP in sight.

Each service has one base class (``ShufflerError``, ``AnalyzerError``) and one subclass per
meaning; every subclass has a stable ``code`` (the ``error`` field clients see) and a
:class:`Kind` that says what sort of refusal it is. :mod:`runtime.http` maps kinds to
HTTP statuses in one table; cores never mention a status.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Kind(StrEnum):
    """What sort of refusal an error is (mapped to a status in one table at the edge)."""

    INVALID = "invalid"  # the request itself is malformed
    UNAUTHENTICATED = "unauthenticated"  # missing, forged or revoked credentials
    FORBIDDEN = "forbidden"  # authenticated but not allowed (e.g. a locked analyzer admin)
    NOT_FOUND = "not_found"  # names something that does not exist
    CONFLICT = "conflict"  # conflicts with what is already stored (replay, quota)
    TOO_LARGE = "too_large"  # over a size limit
    UNSUPPORTED_MEDIA = "unsupported_media"  # wrong Content-Type
    UNPROCESSABLE = "unprocessable"  # well-formed but inconsistent with the configuration
    RATE_LIMITED = "rate_limited"  # slow down; retry after the given delay
    UNAVAILABLE = "unavailable"  # a dependency (the database) failed; nothing was stored


class DomainError(Exception):
    """A refusal with a stable ``code`` and a human ``detail`` (no repr, no secrets)."""

    code: ClassVar[str] = "error"
    kind: ClassVar[Kind] = Kind.INVALID

    def __init__(self, detail: str, *, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"


class StorageUnavailableError(DomainError):
    """The database did not commit; nothing was stored."""

    code = "storage_unavailable"
    kind = Kind.UNAVAILABLE


class RateLimitedError(DomainError):
    """Too many requests from one client or address; retry after ``retry_after`` seconds."""

    code = "rate_limited"
    kind = Kind.RATE_LIMITED


class TooLargeError(DomainError):
    """A body over the configured limit."""

    code = "too_large"
    kind = Kind.TOO_LARGE


class BadAdminTokenError(DomainError):
    """The admin bearer token is missing or wrong."""

    code = "bad_admin_token"
    kind = Kind.UNAUTHENTICATED


class MetricsTokenError(DomainError):
    """``/metrics`` asked for without the metrics bearer token."""

    code = "bad_metrics_token"
    kind = Kind.UNAUTHENTICATED
