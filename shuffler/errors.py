"""What a shuffler refuses, as domain errors with stable codes (no HTTP here); catch
:class:`ShufflerError`. :mod:`runtime.http` maps each error's ``kind`` to the status shown;
details never name a client id, token or timestamp. The tree of codes and statuses:
docs/shuffler.md, "Errors".
"""

from __future__ import annotations

from runtime.errors import (
    BadAdminTokenError,
    DomainError,
    Kind,
    RateLimitedError,
    StorageUnavailableError,
    TooLargeError,
)


class ShufflerError(DomainError):
    """Base of every refusal by a shuffler; catch this one."""


class BadTokenError(ShufflerError):
    """The client token is missing, malformed or forged."""

    code = "bad_token"
    kind = Kind.UNAUTHENTICATED


class RevokedTokenError(ShufflerError):
    """The client token is genuine but revoked."""

    code = "revoked"
    kind = Kind.UNAUTHENTICATED


class AdminTokenError(BadAdminTokenError, ShufflerError):
    """The admin bearer token is missing or wrong."""


class MalformedContributionError(ShufflerError):
    """The sealed contribution does not open or does not parse (or is for another shuffler)."""

    code = "malformed"
    kind = Kind.INVALID


class UnsupportedVersionError(MalformedContributionError):
    """The contribution is of a wire version this shuffler no longer takes (the client must
    update: wire version 1 bound fragments to their channel only)."""

    code = "unsupported_version"


class BadContentTypeError(ShufflerError):
    """The contribution was not sent as ``application/octet-stream``."""

    code = "bad_content_type"
    kind = Kind.INVALID


class UnknownChannelError(ShufflerError):
    """The contribution names a channel this shuffler does not serve."""

    code = "unknown_channel"
    kind = Kind.INVALID


class ChannelRetiredError(ShufflerError):
    """The contribution's channel was retired before its epoch (the device's config is stale:
    it refreshes its config on this answer)."""

    code = "channel_retired"
    kind = Kind.CONFLICT


class ChannelTermsChangedError(ShufflerError):
    """The channel is suspended: the analyzer's config changed its privacy terms in a way that
    relaxes the ones this shuffler pinned, or put them over its ceilings; it takes no more
    contributions (what it took before is still batched), and a channel whose privacy changes
    needs a new channel id."""

    code = "channel_terms_changed"
    kind = Kind.CONFLICT


class ConfigOutdatedError(ShufflerError):
    """The contribution is sealed to an HPKE key this shuffler has retired, or its fragments to
    an analyzer HPKE key the analyzer's config no longer lists (the device's config is stale:
    it refreshes its config on this answer)."""

    code = "config_outdated"
    kind = Kind.CONFLICT


class UnknownCrowdError(ShufflerError):
    """The contribution names a crowd its channel does not declare (``ChannelPolicy.crowds``)."""

    code = "unknown_crowd"
    kind = Kind.INVALID


class EpochNotOpenError(ShufflerError):
    """The contribution's epoch is not open (in the past, the future, or closed by an admin)."""

    code = "epoch_not_open"
    kind = Kind.INVALID


class FutureEpochError(ShufflerError):
    """An admin close of an epoch that has not started: it would refuse every contribution of
    the epochs up to it, for good."""

    code = "epoch_not_started"
    kind = Kind.UNPROCESSABLE


class ReplayedNonceError(ShufflerError):
    """The contribution's nonce was already used."""

    code = "replayed_nonce"
    kind = Kind.CONFLICT


class QuotaExceededError(ShufflerError):
    """One contribution per (client, channel, epoch) was already received (in any crowd)."""

    code = "quota_exceeded"
    kind = Kind.CONFLICT


class BodyTooLargeError(TooLargeError, ShufflerError):
    """The request body is over ``max_body_bytes``."""


class TooManyFragmentsError(ShufflerError):
    """The contribution carries more fragments than its channel's ``max_fragments``."""

    code = "too_many_fragments"
    kind = Kind.TOO_LARGE


class TooFewFragmentsError(ShufflerError):
    """The contribution carries fewer fragments than its channel's ``min_fragments`` (no
    device of the channel's mechanism sends fewer: it would let the analyzer count one
    contribution that carries no report)."""

    code = "too_few_fragments"
    kind = Kind.INVALID


class FragmentSizeError(ShufflerError):
    """A sealed fragment whose length is not its channel's (every fragment of a channel has the
    same length, so a length reveals nothing; and parts stay within what the analyzer reads)."""

    code = "bad_fragment_size"
    kind = Kind.INVALID


class ClientRateLimitedError(RateLimitedError, ShufflerError):
    """Too many requests from one client or address; ``retry_after`` says when to come back."""


class KeyNotLoadedError(ShufflerError):
    """The contribution names an HPKE key this replica does not hold while its key files
    changed (another replica may have just made the key) and could not be read just now:
    retry after ``retry_after`` seconds; nothing was stored."""

    code = "key_not_loaded"
    kind = Kind.UNAVAILABLE


class ShufflerStorageError(StorageUnavailableError, ShufflerError):
    """The database did not commit; nothing was stored or acknowledged."""
