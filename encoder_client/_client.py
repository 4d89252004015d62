"""The client: fetch and verify the collection config, encode, seal, queue, deliver."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from common.collection import (
    CollectionConfigError,
    TrustAnchors,
    VerifiedConfig,
    believed,
    check_moved,
    check_rollback,
    verify_collection,
)
from common.envelope import load_ed25519_public, load_x25519_public
from common.mechanisms import (
    BoundDevice,
    DeviceMechanism,
    MechanismError,
    StaleUpdateError,
    StateConflictError,
    StateUpdate,
    UnknownMechanismError,
    ValueKind,
    get_device,
)
from common.randomness import SystemSource
from common.retry import Backoff, retry_after_seconds
from common.wire import ChannelConfig, DeviceBudget, EnrollResponse, ShufflerInfo
from encoder_client._errors import (
    AlreadyReportedError,
    ChannelError,
    ChannelRetiredError,
    ConfigError,
    InvalidArgumentError,
    StateError,
    StateFileError,
    TrustedKeyError,
    UnknownCrowdError,
    ValueOutOfDomainError,
)
from encoder_client._state import Charge, DeviceState, Limit, OutboxItem
from encoder_client._terms import PrivacyCaps, review
from encoder_client.sealing import seal_report, shuffler_slot

if TYPE_CHECKING:
    from common.fetching import Fetched
    from encoder_client._transport import Transport

log = logging.getLogger("esa.client")
#: Every report's privacy noise: the OS CSPRNG.
_RNG = SystemSource()
#: Outbox retries: 0.5 s doubling to 5 min, jittered so devices that failed together spread out.
OUTBOX_BACKOFF = Backoff(base=0.5, cap=300.0)
#: A shuffler's error codes saying this device's config is behind (a channel retired, a key
#: no longer held) or that the shuffler suspended the channel (its config relaxed the terms
#: the shuffler pinned): the contribution is dropped, never counted as stored, and the config
#: fetched again.
OUTDATED = frozenset({"channel_retired", "config_outdated", "channel_terms_changed"})
#: Said of a contribution refused ``400 epoch_not_open``: its epoch is this device's clock,
#: and a shuffler takes only the epochs its own clock has open (docs/operations.md, "Clock
#: skew"), so a clock minutes off loses its reports (the shuffler's detail, logged, names the
#: open ones).
CLOCK_HINT = " (its epoch is not open at the shuffler: is this device's clock right?)"
#: Least seconds between two config fetches for channels the config does not name.
UNKNOWN_CHANNEL_REFRESH_SECONDS = 10.0
#: Largest answer read from a shuffler to a contribution or an enrolment (a 202, a JSON
#: error or a token: well under a kilobyte).
MAX_ANSWER_BYTES = 64 * 1024


def _transport(timeout: float) -> Transport:
    """The client's HTTP, loaded with the first Client: httpx is not imported by ``import
    encoder_client`` (docs/sdk.md, "What importing costs")."""
    from encoder_client._transport import Transport

    return Transport(timeout)


def _trusted_key(key: object, name: str = "trusted_key") -> Ed25519PublicKey:
    """A pinned Ed25519 key: 32 raw bytes, or their standard base64 (surrounding whitespace,
    such as the newline ending ``var/analyzer.pub``, is ignored).

    Raises:
        TrustedKeyError: naming the value that is not such a key.
    """
    if isinstance(key, str):
        text = key.strip()
        shown = text if len(text) <= 60 else text[:57] + "..."
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as error:
            raise TrustedKeyError(
                f"{name} {shown!r} is not base64 ({error}); pin the keys `esa up` writes to "
                "var/trust.json"
            ) from error
    elif isinstance(key, bytes | bytearray):
        raw, shown = bytes(key), f"{len(key)} raw bytes"
    else:
        raise TrustedKeyError(f"{name} must be base64 text or bytes, not {key!r}")
    if len(raw) != 32:
        raise TrustedKeyError(f"{name} {shown!r} is {len(raw)} bytes; an Ed25519 public key is 32")
    try:
        return load_ed25519_public(raw)
    except ValueError as error:
        raise TrustedKeyError(f"{name} {shown!r} is not an Ed25519 key: {error}") from error


def _trust_anchors(trusted_key: object, shuffler_keys: object, trust_file: object) -> TrustAnchors:
    """One pinned key per trust domain: from ``trust_file``, or the analyzer's ``trusted_key``
    and every shuffler's key in ``shuffler_keys``.

    Raises:
        TrustedKeyError: a key missing or unusable, both ways given, or an unusable file.
    """
    if trust_file is not None:
        if trusted_key is not None or shuffler_keys is not None:
            raise TrustedKeyError("give trust_file, or trusted_key with shuffler_keys, not both")
        try:
            return TrustAnchors.load(Path(trust_file))  # type: ignore[arg-type]
        except (TypeError, ValueError) as error:
            raise TrustedKeyError(str(error)) from error
    if trusted_key is None:
        raise TrustedKeyError(
            "pin one key per trust domain: trust_file (var/trust.json, written by `esa up`), "
            "or trusted_key (the analyzer's) with shuffler_keys"
        )
    if not isinstance(shuffler_keys, Mapping) or not shuffler_keys:
        raise TrustedKeyError(
            "shuffler_keys must map each shuffler id to its signing key: a device takes a "
            "shuffler's HPKE key only from that shuffler's own signature, never the analyzer's"
        )
    shufflers = {str(k): _trusted_key(v, f"shuffler_keys[{k!r}]") for k, v in shuffler_keys.items()}
    return TrustAnchors(_trusted_key(trusted_key), shufflers)


def _read_config_file(path: object) -> Any:
    """The JSON document in a saved config file.

    Raises:
        ConfigError: naming the file and why it cannot be read or parsed.
    """
    try:
        return json.loads(Path(path).read_text())  # type: ignore[arg-type]
    except TypeError as error:
        raise ConfigError(f"config_file must be a path, not {path!r}") from error
    except OSError as error:
        raise ConfigError(f"config_file {str(path)!r} cannot be read: {error}") from error
    except ValueError as error:
        raise ConfigError(f"config_file {str(path)!r} is not JSON: {error}") from error


def _recipient_keys(
    config: VerifiedConfig,
) -> tuple[X25519PublicKey, dict[str, X25519PublicKey]]:
    """The analyzer's current HPKE key and every shuffler's (from its own descriptor), decoded
    once.

    Raises:
        ConfigError: the (verified) config holds an unusable key.
    """
    try:
        analyzer = load_x25519_public(base64.b64decode(config.analyzer.keys[0].public_key))
        shufflers = {
            s.id: load_x25519_public(base64.b64decode(s.public_key)) for s in config.shufflers
        }
    except (IndexError, ValueError) as error:
        raise ConfigError(f"the collection config holds no usable HPKE key: {error}") from error
    return analyzer, shufflers


def _state_path(path: object) -> Path:
    if not isinstance(path, str | Path) or not str(path):
        raise InvalidArgumentError(f"state_path must be a file path, not {path!r}")
    return Path(path)


def _check_arguments(
    timeout: float, interval: float, weights: dict[str, float] | None, crowd: object
) -> None:
    """Refuse arguments that would fail later, far from the call.

    Raises:
        InvalidArgumentError: naming the argument and its value.
    """
    for name, value in (("timeout", timeout), ("flush_interval", interval)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise InvalidArgumentError(f"{name} must be a positive number of seconds: {value!r}")
    if weights is not None:
        bad = {k: w for k, w in weights.items() if not (isinstance(w, int | float) and w >= 0)}
        if bad or not any(w > 0 for w in weights.values()):
            raise InvalidArgumentError(
                f"weights must be non-negative numbers, at least one positive: {weights!r}"
            )
    if crowd is not None and not isinstance(crowd, str):
        raise InvalidArgumentError(f"crowd must be a string, not {crowd!r}")


class Client:
    """An ESA client for one device: verify the signed config, encode, seal, queue and deliver.

    The config is accepted only when the analyzer signed it with the pinned key and every shuffler
    it lists is vouched for by its own descriptor, signed with the key pinned for that shuffler;
    never when it expired or is older than one this device accepted before. Keys are pinned by
    ``trusted_key`` + ``shuffler_keys`` or a ``trust_file``. A channel's privacy terms are
    pinned in the state file at the first config naming it and never relaxed by a later one;
    ``caps`` are the app's own limits (:class:`PrivacyCaps`). Arguments and usage: docs/sdk.md.

    Raises:
        ConfigError: the config cannot be fetched, read or verified (the message names the source).
        TrustedKeyError: a pinned key missing, or not 32 bytes or their base64.
        StateFileError: ``state_path`` cannot be opened, created or written.
        InvalidArgumentError: a non-positive timeout or interval, unusable weights or caps.
    """

    def __init__(
        self,
        config_url: str | None = None,
        *,
        trusted_key: bytes | str | None = None,
        shuffler_keys: Mapping[str, bytes | str] | None = None,
        trust_file: Path | str | None = None,
        every_shuffler: bool = True,
        state_path: Path | str,
        config_file: Path | str | None = None,
        background: bool = True,
        flush_interval: float = 5.0,
        weights: dict[str, float] | None = None,
        crowd: str | None = None,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
        caps: PrivacyCaps | None = None,
    ) -> None:
        _check_arguments(timeout, flush_interval, weights, crowd)
        if caps is not None and not isinstance(caps, PrivacyCaps):
            raise InvalidArgumentError(f"caps must be a PrivacyCaps, not {caps!r}")
        self._caps = caps or PrivacyCaps()
        self._clock = clock
        self._trust = _trust_anchors(trusted_key, shuffler_keys, trust_file)
        self._source = (config_url, config_file)
        self._every_shuffler = every_shuffler
        #: The config fetch, contributions and enrolments: each within ``timeout`` whole.
        self._http = _transport(timeout)
        self._config_lock = threading.Lock()
        #: Serializes :meth:`_accept` (the app's thread and the background flush may both
        #: fetch): each config is checked against the pins the one before it left.
        self._accept_lock = threading.Lock()
        #: A shuffler answered that this device's config is behind (a retired channel or
        #: key): the next report fetches it again first.
        self._stale = False
        #: When the config was last fetched for a channel it did not name (rate-limited).
        self._unknown_refreshed = -float("inf")
        try:
            config = self._load_config()
            self.state = DeviceState(_state_path(state_path))
            try:
                self._accept(config)
            except BaseException:
                self.state.close()
                raise
        except BaseException:
            self._http.close()
            raise
        self._weights = weights
        self._crowd = crowd
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(flush_interval,), daemon=True)
            self._thread.start()

    # --- config ---------------------------------------------------------------------------

    def _load_config(self) -> VerifiedConfig:
        """The signed config from the file or URL, verified with the pinned keys.

        Raises:
            ConfigError: naming the file or URL and what is wrong with it.
        """
        url, path = self._source
        if path is not None:
            source, document = f"config_file {str(path)!r}", _read_config_file(path)
        elif url is not None:
            source, document = f"config_url {url!r}", self._fetch_config(url)
        else:
            raise ConfigError("give config_url or config_file")
        try:
            if not isinstance(document, dict):
                raise CollectionConfigError(f"not a JSON object but {type(document).__name__}")
            return verify_collection(
                document, self._trust, self._clock(), every_shuffler=self._every_shuffler
            )
        except (CollectionConfigError, ValueError, TypeError) as error:
            raise ConfigError(f"collection config from {source} refused: {error}") from error

    def _accept(self, config: VerifiedConfig) -> None:
        """Use ``config`` from now on, unless it is older than one this device accepted or
        signed by a key that does not descend from one it moved its pin to; the pins move to
        its signers (a party's next key, named by the one pinned: a rotation). A channel whose
        terms it relaxes, or that is over the app's caps, takes no report under it
        (:func:`encoder_client._terms.review`); the others' terms are pinned.

        Raises:
            ConfigError: a replayed older config or descriptor, a fork from an older key, or
                an unusable key.
        """
        with self._accept_lock:  # rollback check, review, pin and install as one step
            self._install(config)

    def _install(self, config: VerifiedConfig) -> None:
        """:meth:`_accept`, its lock held."""
        roots = self._trust.roots()
        try:
            check_rollback(config.versions, self.state.seen())
            check_moved(config, self.state.pins(roots))
            analyzer, shufflers = _recipient_keys(config)
            pin, refused = review(config, self.state.pinned_terms(), self._caps)
            self.state.see(believed(config.versions, self._clock()))
            self.state.move_pins(roots, config.pins)
            self.state.pin_terms(pin)
        except CollectionConfigError as error:
            raise ConfigError(f"collection config refused: {error}") from error
        except sqlite3.Error as error:
            raise StateFileError(f"device state file {self.state.path}: {error}") from error
        for why in refused.values():
            log.warning("channel refused: %s", why)
        with self._config_lock:
            self._config = config
            self._analyzer_key, self._shuffler_keys = analyzer, shufflers
            self._channels = {c.id: c for c in config.channels}
            self._refused = refused
            self._shufflers = list(config.shufflers)

    def refresh_config(self) -> None:
        """Fetch and verify the config again (from ``config_url``, or re-read ``config_file``)
        and use it from now on.

        Raises:
            ConfigError: as at construction; the current config stays in use.
        """
        self._accept(self._load_config())

    def _current(self) -> VerifiedConfig:
        """The config in use, fetched again first if it (or a descriptor in it) expired.

        Raises:
            ConfigError: it expired and no valid replacement could be fetched.
        """
        if self._clock() <= self._config.expires_at and not self._stale:
            return self._config
        try:
            self.refresh_config()
            self._stale = False
        except ConfigError as error:
            if self._clock() <= self._config.expires_at:  # stale, still valid: used again
                log.warning("collection config not refreshed", extra={"error": str(error)})
                return self._config
            raise ConfigError(
                f"collection config expired at {self._config.expires_at} and no valid one "
                f"could be fetched: {error}"
            ) from error
        return self._config

    def _fetch_config(self, url: object) -> Any:
        """GET the config document from ``url`` (http or https).

        Raises:
            ConfigError: a malformed URL, a network error, a non-200 or non-JSON answer.
        """
        return self._http.fetch_config(url)

    @property
    def device_id(self) -> str:
        """This device's identity (a new one after the state file is lost)."""
        return self.state.device_id

    def channel(self, channel_id: str) -> ChannelConfig:
        """A channel of the collection config (fetched again once when it names no such
        channel: channels are added while the deployment runs).

        Raises:
            ChannelError: unknown channel.
            PrivacyRelaxedError: the config in force relaxes the terms pinned for it.
            PrivacyCapError: its local ε is above the app's cap.
        """
        config = self._channels.get(channel_id)
        due = self._clock() - self._unknown_refreshed >= UNKNOWN_CHANNEL_REFRESH_SECONDS
        if config is None and self._source[0] is not None and due:
            self._unknown_refreshed = self._clock()
            try:
                self.refresh_config()
            except ConfigError as error:
                log.warning("collection config not refreshed", extra={"error": str(error)})
            config = self._channels.get(channel_id)
        if config is None:
            raise ChannelError(f"channel {channel_id!r} is not in the collection config")
        refused = self._refused.get(channel_id)
        if refused is not None:
            raise refused.with_traceback(None)  # one error per channel, a fresh trace
        return config

    def crowd(self, channel_id: str, crowd: str | None = None) -> str:
        """The crowd this device reports in on ``channel_id``: ``crowd``, else the client's,
        else the channel's first declared crowd (docs/protocol.md, "Channels, epochs and crowds").

        Raises:
            ChannelError: unknown channel.
            UnknownCrowdError: a crowd the channel's signed config does not declare.
        """
        config = self.channel(channel_id)
        chosen = crowd if crowd is not None else self._crowd
        if chosen is None:
            return config.crowds[0]
        if chosen not in config.crowds:
            raise UnknownCrowdError(
                f"crowd {chosen[:80]!r} is not declared for channel {channel_id!r} "
                f"(declared: {', '.join(map(repr, config.crowds))})"
            )
        return chosen

    # --- reporters ------------------------------------------------------------------------

    def histogram(self, channel_id: str, crowd: str | None = None) -> HistogramReporter:
        """Reporter for a channel whose reports are a value in a domain (k-RAPPOR, report
        fragments, k-RR, Balcer–Cheu...), in ``crowd`` (see :meth:`crowd`)."""
        config, mechanism = self._kind(channel_id, ValueKind.CATEGORY)
        return HistogramReporter(self, config, mechanism, self.crowd(channel_id, crowd))

    def counts(self, channel_id: str, crowd: str | None = None) -> HistogramReporter:
        """Reporter for Balcer–Cheu zero-sum histogram channels (same as :meth:`histogram`)."""
        return self.histogram(channel_id, crowd)

    def longitudinal(self, channel_id: str, crowd: str | None = None) -> LongitudinalReporter:
        """Reporter for channels that follow a 0/1 state over periods, in ``crowd``."""
        config, mechanism = self._kind(channel_id, ValueKind.STATE)
        return LongitudinalReporter(self, config, mechanism, self.crowd(channel_id, crowd))

    def _kind(self, channel_id: str, kind: ValueKind) -> tuple[ChannelConfig, DeviceMechanism[Any]]:
        config = self.channel(channel_id)
        try:
            mechanism = get_device(config.mechanism)
        except UnknownMechanismError as error:
            raise ChannelError(f"channel {channel_id!r}: {error}") from error
        if mechanism.value_kind is not kind:
            raise ChannelError(
                f"channel {channel_id!r} is {config.mechanism} ({mechanism.value_kind} values); "
                "use the matching reporter"
            )
        return config, mechanism

    # --- sealing and queueing -------------------------------------------------------------

    def _submit(self, channel: _Channel, crowd: str, value: Any) -> _Channel:
        """A reporter's ``value`` encoded with ``channel`` as the current config states it
        (refreshed first if it expired), sealed and queued with the state; the channel as used.

        Raises:
            ConfigError: the config expired and no valid one could be fetched.
            ChannelError: the channel is gone, or now names another mechanism.
            ChannelRetiredError: the channel takes no report in this epoch.
            StateFileError: the state file can no longer be read or written.
        """
        channel = self._fresh(channel)  # never encode or seal with a config whose vouching expired
        config = channel.config
        epoch = self._epoch(config)
        if not config.takes(epoch):
            raise ChannelRetiredError(
                f"channel {config.id!r} is retired from epoch "
                f"{config.retired_from_epoch} on (this is epoch {epoch})"
            )
        try:
            self._commit(channel, crowd, self._encode(channel, value))
        except sqlite3.Error as error:
            raise StateFileError(f"device state file {self.state.path}: {error}") from error
        return channel

    def _fresh(self, channel: _Channel) -> _Channel:
        """``channel`` as the current config states it (refreshed first if it expired): a
        refresh may publish new parameters (a training round's model) or keys.

        Raises:
            ConfigError: the config expired and no valid one could be fetched.
            ChannelError: the channel is gone, or now names another mechanism.
        """
        self._current()
        config, mechanism = self.channel(channel.config.id), channel.mechanism
        if config is channel.config:
            return channel
        if config.mechanism != mechanism.name:
            raise ChannelError(
                f"channel {config.id!r} is now {config.mechanism}, not {mechanism.name}"
            )
        return _Channel(config, _bound(config, mechanism.mechanism))

    def _encode(self, channel: _Channel, value: Any) -> Any:
        """The mechanism's encoding of ``value`` with this device's saved state."""
        config, mechanism = channel.config, channel.mechanism
        saved = self.state.channel_state(config.id, mechanism.name)
        try:
            state = saved if saved is not None else mechanism.new_state(_RNG)
            return mechanism.encode(value, state, _RNG, len(self._shufflers))
        except StaleUpdateError as error:
            raise AlreadyReportedError(str(error)) from error
        except StateConflictError as error:
            raise StateError(str(error)) from error
        except (MechanismError, TypeError) as error:  # TypeError: e.g. a str for an int
            raise ValueOutOfDomainError(f"{value!r}: {error}") from error

    def _commit(self, channel: _Channel, crowd: str, encoded: Any) -> None:
        """Seal the encoded report's routes and queue them with the state in one transaction."""
        config, mechanism = channel.config, channel.mechanism
        if not encoded.routes:
            if encoded.state is not None:
                self.state.save_state(config.id, mechanism.name, encoded.state)
            return
        epoch = self._epoch(config)
        outbox = [
            self._seal(config, crowd, epoch, self._route(slot), list(fragments))
            for slot, fragments in encoded.routes
        ]
        charge = self._charge(config, epoch, mechanism.local_privacy().replacement)
        self._queue(config, epoch, mechanism.name, encoded.state, outbox, charge)

    def _epoch(self, config: ChannelConfig) -> int:
        return int(self._clock() // config.epoch_seconds)

    def _route(self, slot: int | None) -> ShufflerInfo:
        """Shuffler ``slot mod K``, or one picked by weight when the mechanism lets us."""
        weights = [self._weights.get(s.id, 0.0) for s in self._shufflers] if self._weights else []
        return self._shufflers[shuffler_slot(slot, len(self._shufflers), weights)]

    def _seal(
        self,
        config: ChannelConfig,
        crowd: str,
        epoch: int,
        shuffler: ShufflerInfo,
        fragments: list[bytes],
    ) -> tuple[str, bytes]:
        key = self._shuffler_keys[shuffler.id]
        body = seal_report(
            config,
            crowd=crowd,
            epoch=epoch,
            fragments=fragments,
            analyzer_key=self._analyzer_key,
            shuffler=(shuffler.id, key),
        )
        return shuffler.id, body

    def _queue(
        self,
        config: ChannelConfig,
        epoch: int,
        kind: str,
        data: dict[str, Any] | None,
        outbox: list[tuple[str, bytes]],
        charge: Charge | None = None,
    ) -> None:
        if not self.state.commit_report(config.id, epoch, kind, data, outbox, charge):
            raise AlreadyReportedError(
                f"channel {config.id!r} already has a report in epoch {epoch}"
            )
        self._wake.set()

    def _charge(self, config: ChannelConfig, epoch: int, eps: float) -> Charge:
        """A report's local ε with the budgets of the signed config it must fit."""
        start = float(epoch * config.epoch_seconds)
        budgets = ((config.id, config.budget), (None, self._config.device_budget))
        limits = [
            limit for scope, b in budgets if b is not None for limit in _limits(scope, b, start)
        ]
        if self._caps.lifetime_eps is not None:
            limits.append(Limit(self._caps.lifetime_eps, None, None, by_app=True))
        return Charge(eps, start, tuple(limits))

    def budget_spent(self, channel_id: str | None = None) -> float:
        """Local ε (replacement notion, basic composition) this device has spent on
        ``channel_id``, or on every channel when None."""
        return self.state.spent(channel_id)

    # --- delivery -------------------------------------------------------------------------

    def flush(self) -> int:
        """Try to deliver every due contribution now; returns how many were delivered
        (network errors and refusals are retried later, never raised). Each shuffler is sent
        to in a thread of its own and each POST has a whole-request deadline (``timeout``), so
        a shuffler that answers slowly delays no other's deliveries.

        Raises:
            StateFileError: the state file can no longer be read or written.
        """
        try:
            self._current()
        except ConfigError as error:  # nothing is sent with keys nobody vouches for any more
            log.warning("delivery postponed: %s", error)
            return 0
        try:
            queues: dict[str, list[OutboxItem]] = {}
            for item in self.state.due(self._clock()):
                queues.setdefault(item.shuffler_id, []).append(item)
            if not queues:
                return 0
            with ThreadPoolExecutor(len(queues), thread_name_prefix="esa-deliver") as pool:
                return sum(pool.map(self._deliver_queue, queues.values()))
        except sqlite3.Error as error:
            raise StateFileError(f"device state file {self.state.path}: {error}") from error

    def _deliver_queue(self, items: list[OutboxItem]) -> int:
        """Deliver one shuffler's due items in order; after one that could not reach it
        (network error, deadline) the rest wait for the next round."""
        delivered = 0
        for item in items:
            outcome = self._deliver(item)
            if outcome is None:
                break
            delivered += outcome
        return delivered

    def _deliver(self, item: OutboxItem) -> int | None:
        """Send one item: 1 delivered, 0 not (kept or dropped by its answer), None when its
        shuffler could not be reached within the deadline (the item backs off)."""
        shuffler = next((s for s in self._shufflers if s.id == item.shuffler_id), None)
        if shuffler is None:
            log.warning("outbox entry for a shuffler no longer configured; kept")
            self.state.retry_later(item.id, self._clock() + 3600)
            return 0
        try:
            token = self.state.token(shuffler.id) or self._enroll(shuffler)
            response = self._http.post(
                shuffler.url + "/v1/contributions",
                content=item.body,
                headers={
                    "Authorization": f"Bearer {token}",
                    "Content-Type": "application/octet-stream",
                },
                limit=MAX_ANSWER_BYTES,
            )
        except (ConnectionError, ValueError):  # network, deadline, or an answer we cannot use
            self._backoff(item)
            return None
        return self._answered(shuffler, item, response)

    def _answered(self, shuffler: ShufflerInfo, item: OutboxItem, response: Fetched) -> int:
        """Act on a shuffler's answer to one item; 1 when it is delivered."""
        code = _error_code(response.body) if response.status >= 400 else None
        if code in OUTDATED:  # the config is behind: refreshed before the next report
            log.warning("contribution refused: config outdated; dropped", extra={"error": code})
            self._stale = True
            self.state.delivered(item.id)
            return 0
        if response.status in (202, 409):  # 409: already stored (a lost 202) — done
            self.state.delivered(item.id)
            return 1
        if code == "unknown_channel":  # a channel added moments ago: the shuffler adopts it
            self._backoff(item)  # within seconds; once its epoch closes: epoch_not_open
            return 0
        if response.status == 401:
            self.state.set_token(shuffler.id, "")
            self._backoff(item)
        elif response.status == 429:
            wait = retry_after_seconds(response.headers)
            self.state.retry_later(item.id, self._clock() + max(1.0, wait or 1.0))
        elif response.status in (400, 413):
            why = CLOCK_HINT if code == "epoch_not_open" else ""
            log.error(
                f"contribution refused for good{why}; dropped",
                extra={
                    "shuffler": shuffler.id,
                    "status": response.status,
                    "error": code,
                    "detail": _error_detail(response.body),
                },
            )
            self.state.delivered(item.id)
        else:
            self._backoff(item)
        return 0

    def _enroll(self, shuffler: ShufflerInfo) -> str:
        """A client token from ``shuffler`` (within the whole-request deadline).

        Raises:
            ConnectionError: network failure or deadline; ValueError: a refusal or an answer
            that is not an enrolment.
        """
        response = self._http.post(shuffler.url + "/v1/enroll", limit=MAX_ANSWER_BYTES)
        if response.status != 200:
            raise ValueError(f"enrolment at {shuffler.id} answered HTTP {response.status}")
        token = EnrollResponse.model_validate_json(response.body).client_token
        self.state.set_token(shuffler.id, token)
        return token

    def _backoff(self, item: OutboxItem) -> None:
        delay = OUTBOX_BACKOFF.delay(item.attempts, _RNG)
        self.state.retry_later(item.id, self._clock() + delay)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.flush()
            except Exception:  # the background thread must survive any single failure
                log.exception("background flush failed")

    def close(self) -> None:
        """Stop background delivery and release the state file (the outbox persists)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._http.close()
        self.state.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error_detail(answer: bytes) -> str | None:
    """The ``detail`` of a JSON error body (at most 300 characters), None for any other."""
    try:
        body = json.loads(answer)
    except ValueError:
        return None
    detail = body.get("detail") if isinstance(body, dict) else None
    return str(detail)[:300] if detail is not None else None


def _error_code(answer: bytes) -> str | None:
    """The ``error`` of a JSON error body, None for any other body."""
    try:
        body = json.loads(answer)
    except ValueError:
        return None
    return str(body.get("error")) if isinstance(body, dict) else None


def _limits(scope: str | None, budget: DeviceBudget, epoch_start: float) -> list[Limit]:
    """The caps of one budget for a report of the epoch that starts at ``epoch_start``."""
    limits = []
    if budget.lifetime_eps is not None:
        limits.append(Limit(budget.lifetime_eps, scope))
    if budget.window_eps is not None and budget.window_seconds is not None:
        since = epoch_start - budget.window_seconds + 1
        limits.append(Limit(budget.window_eps, scope, since))
    return limits


def _bound(config: ChannelConfig, mechanism: DeviceMechanism[Any]) -> BoundDevice[object]:
    """``mechanism`` with ``config``'s parameters bound.

    Raises:
        ChannelError: the parameters do not validate.
    """
    try:
        return mechanism.bind(config.params)
    except (TypeError, ValueError) as error:
        raise ChannelError(f"channel {config.id!r} does not validate: {error}") from error


@dataclass(frozen=True, slots=True)
class _Channel:
    """A reporter's channel: its config as last used and its mechanism with those parameters."""

    config: ChannelConfig
    mechanism: BoundDevice[object]


class Reporter:
    """Reports on one channel, in one of its declared crowds, through its mechanism (one
    contribution per epoch, whatever the crowd: docs/protocol.md's quota), with the channel as the
    client's current config states it at each report (:meth:`Client._submit`)."""

    def __init__(
        self,
        client: Client,
        config: ChannelConfig,
        mechanism: DeviceMechanism[Any],
        crowd: str = "",
    ) -> None:
        self._client = client
        self.crowd = crowd
        self._channel = _Channel(config, _bound(config, mechanism))

    def _submit(self, value: Any) -> None:
        """Encode, seal and queue ``value`` with the channel as it is now (see the callers)."""
        self._channel = self._client._submit(self._channel, self.crowd, value)


class HistogramReporter(Reporter):
    """Reports one value per epoch on a histogram-type channel."""

    def report(self, value: int) -> None:
        """Encode, seal and queue this epoch's report of ``value``.

        Raises:
            ValueOutOfDomainError: the channel cannot encode ``value``.
            AlreadyReportedError: this channel already has a report this epoch.
            StateError: the saved device state was drawn for other parameters.
            BudgetExceededError: the report would exceed a local-ε budget of the config.
            ConfigError: the config expired and no valid one could be fetched.
        """
        self._submit(value)


class LongitudinalReporter(Reporter):
    """Reports a 0/1 state over periods (Erlingsson et al. 2019, Algorithm 1)."""

    def update(self, period: int, changed: bool) -> None:
        """Tell the SDK whether the state changed at ``period`` (1..d, increasing).

        Raises:
            ValueOutOfDomainError: period outside 1..d.
            AlreadyReportedError: a period at or before the last one given, or a second report
                in the same epoch.
            BudgetExceededError: the report would exceed a local-ε budget of the config.
            ConfigError: the config expired and no valid one could be fetched.
        """
        self._submit(StateUpdate(period, changed))
