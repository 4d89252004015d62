"""The client: fetch and verify the collection config, encode, seal, queue, deliver."""

from __future__ import annotations

import base64
import functools
import json
import logging
import secrets
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from common.collection import CollectionConfigError, verify_config
from common.envelope import (
    Contribution,
    load_ed25519_public,
    load_x25519_public,
    new_nonce,
    seal_contribution,
    seal_fragment,
)
from common.mechanisms import (
    Mechanism,
    MechanismError,
    StaleUpdateError,
    StateConflictError,
    StateUpdate,
    UnknownMechanismError,
    ValueKind,
)
from common.mechanisms import get as get_mechanism
from common.randomness import SystemSource
from common.retry import Backoff, retry_after_seconds
from common.wire import (
    ChannelConfig,
    CollectionConfig,
    DeviceBudget,
    EnrollResponse,
    ShufflerInfo,
)
from encoder_client._errors import (
    AlreadyReportedError,
    ChannelError,
    ConfigError,
    StateError,
    ValueOutOfDomainError,
)
from encoder_client._state import Charge, DeviceState, Limit, OutboxItem

log = logging.getLogger("esa.client")
#: Every report's privacy noise: the OS CSPRNG.
_RNG = SystemSource()
#: Outbox retries: 0.5 s doubling to 5 min, jittered so devices that failed together spread out.
OUTBOX_BACKOFF = Backoff(base=0.5, cap=300.0)


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context (httpx's trust store, certifi) shared by every Client:
    building one reads the whole CA bundle, about 35 ms, which apps that open a Client per
    report (and ``esa demo``'s thousands of devices) should not pay each time."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


class Client:
    """An ESA client for one device.

    Args:
        config_url: The analyzer's ``/v1/config`` URL (or give ``config_file``).
        trusted_key: The analyzer's Ed25519 signing key (raw 32 bytes or base64), pinned by the
            app: a config signed by any other key is refused.
        state_path: The device's SQLite state file (created on first use).
        config_file: A saved signed config document instead of ``config_url``.
        background: Deliver the outbox from a background thread (``flush()`` always works).
        flush_interval: Seconds between background delivery attempts.
        weights: Relative trust in each shuffler id for routing (default: uniform).
        timeout: HTTP timeout in seconds.
        clock: Time source (tests).

    Raises:
        ConfigError: unreachable, unsigned, mis-signed, tampered or expired config.
    """

    def __init__(
        self,
        config_url: str | None = None,
        *,
        trusted_key: bytes | str,
        state_path: Path | str,
        config_file: Path | str | None = None,
        background: bool = True,
        flush_interval: float = 5.0,
        weights: dict[str, float] | None = None,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._http = httpx.Client(timeout=timeout, verify=_tls_context())
        self._config = self._load_config(config_url, config_file, trusted_key)
        self._channels = {c.id: c for c in self._config.channels}
        self._shufflers = list(self._config.shufflers)
        self._analyzer_key = load_x25519_public(
            base64.b64decode(self._config.analyzer.keys[0].public_key)
        )
        self._weights = weights
        self.state = DeviceState(Path(state_path))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(flush_interval,), daemon=True)
            self._thread.start()

    # --- config ---------------------------------------------------------------------------

    def _load_config(
        self, url: str | None, path: Path | str | None, key: bytes | str
    ) -> CollectionConfig:
        raw_key = base64.b64decode(key) if isinstance(key, str) else key
        try:
            if path is not None:
                document = json.loads(Path(path).read_text())
            elif url is not None:
                document = self._http.get(url).raise_for_status().json()
            else:
                raise ConfigError("give config_url or config_file")
            return verify_config(document, load_ed25519_public(raw_key), self._clock())
        except (CollectionConfigError, httpx.HTTPError, OSError, ValueError) as error:
            raise ConfigError(f"collection config refused: {error}") from error

    @property
    def device_id(self) -> str:
        """This device's identity (a new one after the state file is lost)."""
        return self.state.device_id

    def channel(self, channel_id: str) -> ChannelConfig:
        """A channel of the collection config.

        Raises:
            ChannelError: unknown channel.
        """
        config = self._channels.get(channel_id)
        if config is None:
            raise ChannelError(f"channel {channel_id!r} is not in the collection config")
        return config

    # --- reporters ------------------------------------------------------------------------

    def histogram(self, channel_id: str) -> HistogramReporter:
        """Reporter for a channel whose reports are a value in a domain (k-RAPPOR, report
        fragments, k-RR, Balcer–Cheu...)."""
        config, mechanism = self._kind(channel_id, ValueKind.CATEGORY)
        return HistogramReporter(self, config, mechanism)

    def counts(self, channel_id: str) -> HistogramReporter:
        """Reporter for Balcer–Cheu zero-sum histogram channels (same as :meth:`histogram`)."""
        return self.histogram(channel_id)

    def longitudinal(self, channel_id: str) -> LongitudinalReporter:
        """Reporter for channels that follow a 0/1 state over periods."""
        config, mechanism = self._kind(channel_id, ValueKind.STATE)
        return LongitudinalReporter(self, config, mechanism)

    def _kind(self, channel_id: str, kind: ValueKind) -> tuple[ChannelConfig, Mechanism[Any, Any]]:
        config = self.channel(channel_id)
        try:
            mechanism = get_mechanism(config.mechanism)
        except UnknownMechanismError as error:
            raise ChannelError(f"channel {channel_id!r}: {error}") from error
        if mechanism.value_kind is not kind:
            raise ChannelError(
                f"channel {channel_id!r} is {config.mechanism} ({mechanism.value_kind} values); "
                "use the matching reporter"
            )
        return config, mechanism

    # --- sealing and queueing -------------------------------------------------------------

    def _epoch(self, config: ChannelConfig) -> int:
        return int(self._clock() // config.epoch_seconds)

    def _route(self, slot: int | None) -> ShufflerInfo:
        """Shuffler ``slot mod K``, or one picked by weight when the mechanism lets us."""
        return self._pick() if slot is None else self._shufflers[slot % len(self._shufflers)]

    def _pick(self) -> ShufflerInfo:
        if not self._weights:
            return self._shufflers[secrets.randbelow(len(self._shufflers))]
        total = sum(self._weights.get(s.id, 0.0) for s in self._shufflers)
        point = secrets.randbelow(1 << 30) / (1 << 30) * total
        for shuffler in self._shufflers:
            point -= self._weights.get(shuffler.id, 0.0)
            if point < 0:
                return shuffler
        return self._shufflers[-1]

    def _seal(
        self, config: ChannelConfig, epoch: int, shuffler: ShufflerInfo, fragments: list[bytes]
    ) -> tuple[str, bytes]:
        sealed = tuple(
            seal_fragment(f, config.id, config.payload_size, self._analyzer_key) for f in fragments
        )
        contribution = Contribution(config.id, "", epoch, new_nonce(), sealed)
        key = load_x25519_public(base64.b64decode(shuffler.public_key))
        return shuffler.id, seal_contribution(contribution, shuffler.id, key)

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
        return Charge(eps, start, tuple(limits))

    def budget_spent(self, channel_id: str | None = None) -> float:
        """Local ε (replacement notion, basic composition) this device has spent on
        ``channel_id``, or on every channel when None."""
        return self.state.spent(channel_id)

    # --- delivery -------------------------------------------------------------------------

    def flush(self) -> int:
        """Try to deliver every due contribution now; returns how many were delivered."""
        delivered = 0
        for item in self.state.due(self._clock()):
            delivered += self._deliver(item)
        return delivered

    def _deliver(self, item: OutboxItem) -> int:
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
            )
        except httpx.HTTPError:
            self._backoff(item)
            return 0
        if response.status_code in (202, 409):  # 409: already stored (a lost 202) — done
            self.state.delivered(item.id)
            return 1
        if response.status_code == 401:
            self.state.set_token(shuffler.id, "")
            self._backoff(item)
        elif response.status_code == 429:
            wait = retry_after_seconds(response.headers)
            self.state.retry_later(item.id, self._clock() + max(1.0, wait or 1.0))
        elif response.status_code in (400, 413):
            log.error(
                "contribution refused for good; dropped",
                extra={
                    "shuffler": shuffler.id,
                    "status": response.status_code,
                    "error": response.json().get("error"),
                },
            )
            self.state.delivered(item.id)
        else:
            self._backoff(item)
        return 0

    def _enroll(self, shuffler: ShufflerInfo) -> str:
        response = self._http.post(shuffler.url + "/v1/enroll").raise_for_status()
        token = EnrollResponse.model_validate(response.json()).client_token
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


def _limits(scope: str | None, budget: DeviceBudget, epoch_start: float) -> list[Limit]:
    """The caps of one budget for a report of the epoch that starts at ``epoch_start``."""
    limits = []
    if budget.lifetime_eps is not None:
        limits.append(Limit(budget.lifetime_eps, scope))
    if budget.window_eps is not None and budget.window_seconds is not None:
        since = epoch_start - budget.window_seconds + 1
        limits.append(Limit(budget.window_eps, scope, since))
    return limits


class Reporter:
    """Reports on one channel through its mechanism (one contribution per epoch)."""

    def __init__(self, client: Client, config: ChannelConfig, mechanism: Mechanism[Any, Any]):
        self._client = client
        self._config = config
        self._mechanism = mechanism
        try:
            self._params = mechanism.parse_params(config.params)
        except (TypeError, ValueError) as error:
            raise ChannelError(f"channel {config.id!r} does not validate: {error}") from error

    def _submit(self, value: Any) -> None:
        """Encode ``value`` with the channel's mechanism, seal and queue it with the state."""
        client, config, mechanism = self._client, self._config, self._mechanism
        saved = client.state.channel_state(config.id, mechanism.name)
        try:
            state = saved if saved is not None else mechanism.new_state(self._params, _RNG)
            encoded = mechanism.encode(self._params, value, state, _RNG, len(client._shufflers))
        except StaleUpdateError as error:
            raise AlreadyReportedError(str(error)) from error
        except StateConflictError as error:
            raise StateError(str(error)) from error
        except MechanismError as error:
            raise ValueOutOfDomainError(str(error)) from error
        if not encoded.routes:
            if encoded.state is not None:
                client.state.save_state(config.id, mechanism.name, encoded.state)
            return
        epoch = client._epoch(config)
        outbox = [
            client._seal(config, epoch, client._route(slot), list(fragments))
            for slot, fragments in encoded.routes
        ]
        charge = client._charge(config, epoch, mechanism.local_privacy(self._params).replacement)
        client._queue(config, epoch, mechanism.name, encoded.state, outbox, charge)


class HistogramReporter(Reporter):
    """Reports one value per epoch on a histogram-type channel."""

    def report(self, value: int) -> None:
        """Encode, seal and queue this epoch's report of ``value``.

        Raises:
            ValueOutOfDomainError: the channel cannot encode ``value``.
            AlreadyReportedError: this channel already has a report this epoch.
            StateError: the saved device state was drawn for other parameters.
            BudgetExceededError: the report would exceed a local-ε budget of the config.
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
        """
        self._submit(StateUpdate(period, changed))
