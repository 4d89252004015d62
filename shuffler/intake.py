"""Intake (docs/protocol.md, "Contributions" and "Client tokens"): who may send, how often,
and whether a sealed contribution is acceptable — before anything is stored.

* :class:`TokenAuthority`: bearer tokens ``client_id.HMAC`` verified without a per-token lookup,
  plus a revocation set.
* :class:`RateLimiter`: token buckets per client (or address) whose state is bounded and expires,
  so the shuffler never keeps a long-lived per-client record in memory.
* :class:`Intake`: opens a contribution with the shuffler's HPKE key and checks it against the
  channel's policy (its declared crowds, fragment limit) and the open epochs → a
  :class:`~shuffler.records.Pending` record. The quota (one contribution per client, channel and
  epoch, whatever crowd it names: docs/protocol.md) and the nonce replay check are the store's:
  unique constraints on PostgreSQL, :mod:`shuffler.uniqueness` on SQLite; :func:`refusal`
  names what a conflict means.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from common.envelope import (
    KEY_ID_SIZE,
    Contribution,
    EnvelopeError,
    KeyRing,
    RetiredKeyError,
    UnknownKeyError,
    WireVersionError,
    inner_size,
    open_contribution,
)
from common.wire import ChannelPolicy
from runtime.keys import CATCH_UP_SECONDS
from shuffler.errors import (
    BadTokenError,
    ChannelRetiredError,
    ChannelTermsChangedError,
    ClientRateLimitedError,
    ConfigOutdatedError,
    EpochNotOpenError,
    FragmentSizeError,
    KeyNotLoadedError,
    MalformedContributionError,
    QuotaExceededError,
    ReplayedNonceError,
    RevokedTokenError,
    ShufflerError,
    TooFewFragmentsError,
    TooManyFragmentsError,
    UnknownChannelError,
    UnknownCrowdError,
    UnsupportedVersionError,
)
from shuffler.policies import ChannelPolicies
from shuffler.records import Conflict, Pending
from shuffler.settings import ShufflerSettings

#: Most keys a rate limiter remembers; the least recently seen are forgotten first (a forgotten
#: key starts again with a full bucket, which only ever errs on the client's side).
MAX_TRACKED_KEYS = 100_000


class TokenAuthority:
    """Client tokens ``client_id.mac`` with ``mac = HMAC-SHA256(secret, client_id)``."""

    def __init__(self, secret: bytes, revoked: set[str] | None = None) -> None:
        self._secret = secret
        self.revoked = revoked if revoked is not None else set()

    def _mac(self, client_id: str) -> str:
        # hmac.new, not hmac.digest: the one-shot function releases the GIL even for a few
        # bytes, and on the event loop thread getting it back can wait for other threads.
        digest = hmac.new(self._secret, client_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self) -> str:
        """A new client id (128 random bits) and its token."""
        client_id = secrets.token_hex(16)
        return f"{client_id}.{self._mac(client_id)}"

    def verify(self, token: str) -> str:
        """The client id of a valid, unrevoked token.

        Raises:
            BadTokenError: for a missing, malformed or forged token.
            RevokedTokenError: for a revoked one.
        """
        client_id, _, mac = token.partition(".")
        # Bytes, not str: compare_digest raises TypeError on non-ASCII text (a 500, not a 401).
        supplied, expected = mac.encode("utf-8", "surrogateescape"), self._mac(client_id).encode()
        if not client_id or not mac or not hmac.compare_digest(supplied, expected):
            raise BadTokenError("client token is missing, malformed or forged")
        if client_id in self.revoked:
            raise RevokedTokenError("client token has been revoked")
        return client_id


@dataclass
class RateLimiter:
    """Token buckets per key: ``rate`` tokens per second up to ``burst``.

    A bucket that has refilled completely is indistinguishable from a fresh one, so it is
    dropped; at most ``max_keys`` buckets are kept (least recently used dropped first).
    """

    rate: float
    burst: float
    max_keys: int = MAX_TRACKED_KEYS
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.burst >= 1:
            raise ValueError(f"need rate > 0 and burst >= 1, got {self.rate=}, {self.burst=}")

    def take(self, key: str, now: float) -> float:
        """Take one token for ``key``: 0 when granted, else the seconds until one is free."""
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens - 1.0 if wait == 0.0 else tokens, now)
        self._expire(now)
        return wait

    def check(self, key: str, now: float, detail: str) -> None:
        """:meth:`take`, refusing when no token is free.

        Raises:
            ClientRateLimitedError: with ``retry_after`` in whole seconds.
        """
        wait = self.take(key, now)
        if wait:
            raise ClientRateLimitedError(detail, retry_after=math.ceil(wait))

    def __len__(self) -> int:
        return len(self._buckets)

    def _expire(self, now: float) -> None:
        full_after = self.burst / self.rate
        while self._buckets:
            oldest, (_, last) = next(iter(self._buckets.items()))
            if len(self._buckets) <= self.max_keys and now - last < full_after:
                return
            del self._buckets[oldest]


def open_epochs(policy: ChannelPolicy, now: float, grace: float, skew: float = 0.0) -> set[int]:
    """The epochs a contribution may name now: the current one, the previous one during the
    first ``grace`` seconds of the current (requests in flight), and the next one during the
    last ``skew`` seconds of the current (a device whose clock is ahead by up to ``skew``)."""
    period = policy.epoch_seconds
    current = int(now // period)
    epochs = {current}
    if now - current * period < grace:
        epochs.add(current - 1)
    if (current + 1) * period - now <= skew:
        epochs.add(current + 1)
    return epochs


def refusal(conflict: Conflict) -> ShufflerError:
    """The refusal a client gets when the database did not take its contribution."""
    if conflict is Conflict.REPLAYED_NONCE:
        return ReplayedNonceError("nonce already used")
    if conflict is Conflict.REVOKED:
        return RevokedTokenError("client token has been revoked")
    if conflict is Conflict.CLOSED:
        return EpochNotOpenError("the contribution's epoch has been closed")
    return QuotaExceededError("one contribution per (client, channel, epoch) already received")


def _never(_: bytes) -> bool:
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class IntakeHooks:
    """What the intake asks the rest of the shuffler, given at construction.

    Attributes:
        on_unknown_channel: Called when a contribution names a channel not served (yet): a
            follower of the analyzer's config fetches it again.
        keys_stale: When a contribution names an HPKE key id not in the ring: whether the key
            files changed since they were read (cheap).
        on_unknown_key: Called off the event loop, reads the key files again (another replica
            may have just rotated), True once it did (then :meth:`Intake.validate` is asked
            again with ``looked``). None: a fixed ring.
        analyzer_key_retired: Whether an analyzer HPKE key id was retired (as the followed
            config says; a shuffler that does not follow the analyzer cannot tell).
    """

    on_unknown_channel: Callable[[], None] = lambda: None
    keys_stale: Callable[[], bool] = lambda: False
    on_unknown_key: Callable[[], bool] | None = None
    analyzer_key_retired: Callable[[bytes], bool] = _never


class Intake:
    """Validates contributions; ``closed_upto`` is shared with the batching schedule."""

    def __init__(
        self,
        settings: ShufflerSettings,
        ring: KeyRing,
        clock: Callable[[], float],
        policies: ChannelPolicies,
        hooks: IntakeHooks | None = None,
    ) -> None:
        self.settings = settings
        self.ring = ring
        self.policies = policies
        self.hooks = hooks or IntakeHooks()
        self.clock = clock
        self.tokens = TokenAuthority(settings.token_secret.get_secret_value().encode())
        self.contributions = RateLimiter(settings.rate_per_second, settings.rate_burst)
        per_second = settings.enroll_per_minute / 60.0
        self.enrolments = RateLimiter(per_second, max(1.0, settings.enroll_per_minute / 6))
        self.closed_upto: dict[str, int] = {}

    def validate(self, client_id: str, blob: bytes, looked: bool = False) -> Pending:
        """Open and check one contribution of an authenticated client (nothing is stored);
        ``looked``: the keys were read again since it named a key this replica lacked.

        Raises:
            MalformedContributionError (UnsupportedVersionError: an old wire version; a key
            still unknown once ``looked``), UnknownChannelError, ChannelTermsChangedError (a
            suspended channel), ChannelRetiredError,
            TooFewFragmentsError, FragmentSizeError, UnknownCrowdError, TooManyFragmentsError,
            EpochNotOpenError, ConfigOutdatedError (sealed to a key this shuffler retired),
            KeyNotLoadedError (a key it lacks: :attr:`IntakeHooks.on_unknown_key`, then again).
        """
        try:
            contribution = self._open(blob, looked)
        except WireVersionError as error:
            raise UnsupportedVersionError(str(error)) from error
        except RetiredKeyError as error:
            raise ConfigOutdatedError(f"{error}: fetch the config again") from error
        except EnvelopeError as error:
            raise MalformedContributionError(str(error)) from error
        policy = self.policies.get(contribution.channel_id)
        if policy is None:
            self.hooks.on_unknown_channel()
            raise UnknownChannelError(f"channel {contribution.channel_id!r} is not served here")
        if self.policies.suspension(policy.id) is not None:
            raise ChannelTermsChangedError(
                f"channel {policy.id!r} is suspended: the analyzer's config changed its privacy "
                "terms (a channel whose privacy changes needs a new channel id)"
            )
        if not policy.takes(contribution.epoch):
            raise ChannelRetiredError(
                f"channel {policy.id!r} is retired from epoch {policy.retired_from_epoch} on"
            )
        if contribution.crowd_id not in policy.crowds:
            raise UnknownCrowdError(
                f"crowd {contribution.crowd_id[:64]!r} is not declared for channel {policy.id!r}"
            )
        if len(contribution.fragments) > policy.max_fragments:
            raise TooManyFragmentsError(
                f"{len(contribution.fragments)} fragments > max_fragments={policy.max_fragments}"
            )
        if len(contribution.fragments) < policy.min_fragments:
            raise TooFewFragmentsError(
                f"{len(contribution.fragments)} fragments < min_fragments={policy.min_fragments}"
            )
        self._check_fragments(policy, contribution.fragments)
        now = self.clock()
        settings = self.settings
        epochs = open_epochs(policy, now, settings.epoch_grace_seconds, settings.epoch_skew_seconds)
        if contribution.epoch not in epochs:
            raise EpochNotOpenError(
                f"epoch {contribution.epoch} is not open (open: {sorted(epochs)}; a later one "
                f"once it starts within {settings.epoch_skew_seconds:g} s of this shuffler's clock)"
            )
        if contribution.epoch <= self.closed_upto.get(policy.id, -1):  # said only of open ones
            raise EpochNotOpenError(f"epoch {contribution.epoch} is closed (by an admin)")
        return Pending(client_id, contribution, now)

    def _check_fragments(self, policy: ChannelPolicy, fragments: tuple[bytes, ...]) -> None:
        """Each fragment is the channel's sealed size and sealed to an analyzer key the
        analyzer still lists (a fragment's first bytes name the key it is sealed to).

        Raises:
            FragmentSizeError: a fragment of another size.
            ConfigOutdatedError: one sealed to an analyzer key retired since (the device
                fetches the config again and seals its next report to a current key).
        """
        size = inner_size(policy.payload_size)
        if any(len(fragment) != size for fragment in fragments):
            raise FragmentSizeError(
                f"every fragment of channel {policy.id!r} is {size} bytes sealed "
                f"(payload_size={policy.payload_size})"
            )
        was_retired = self.hooks.analyzer_key_retired
        retired = {f[:KEY_ID_SIZE] for f in fragments if was_retired(f[:KEY_ID_SIZE])}
        if retired:
            raise ConfigOutdatedError(
                f"fragments sealed to the analyzer's key {min(retired).hex()}, now retired: "
                "fetch the config again"
            )

    def _open(self, blob: bytes, looked: bool) -> Contribution:
        """The contribution sealed in ``blob``.

        Raises:
            KeyNotLoadedError: it names a key id this replica lacks while its key files
                changed since it read them (:attr:`IntakeHooks.keys_stale`), not ``looked`` for yet.
            EnvelopeError: it does not open (a key id in no key file: garbage).
        """
        try:
            return open_contribution(blob, self.settings.shuffler_id, self.ring)
        except UnknownKeyError as error:
            if looked or self.hooks.on_unknown_key is None or not self.hooks.keys_stale():
                raise
            raise KeyNotLoadedError(
                f"{error}: this replica reads its keys again; retry", retry_after=CATCH_UP_SECONDS
            ) from error

    def catch_up(self, client_id: str, blob: bytes) -> Pending:
        """:meth:`validate` for a blob naming a key this replica lacked: the keys read again
        (blocking: off the event loop), then opened once more.

        Raises:
            KeyNotLoadedError: the key files could not be read just now (retry).
            ShufflerError: as :meth:`validate`.
        """
        if self.hooks.on_unknown_key is None or not self.hooks.on_unknown_key():
            raise KeyNotLoadedError(
                "this replica could not read its changed keys just now; retry",
                retry_after=CATCH_UP_SECONDS,
            )
        return self.validate(client_id, blob, looked=True)

    def close(self, channel_id: str, epoch: int) -> None:
        """Refuse contributions to every epoch <= ``epoch`` of a channel from now on."""
        self.closed_upto[channel_id] = max(epoch, self.closed_upto.get(channel_id, -1))
