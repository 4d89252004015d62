"""Analyzer settings: environment variables ``ESA_ANALYZER_*`` (or a ``.env`` file).

Channels come from ``ESA_ANALYZER_CHANNELS`` (JSON list of :class:`ChannelConfig`) or
``ESA_ANALYZER_CHANNELS_FILE``; the shuffler registry from ``ESA_ANALYZER_SHUFFLERS`` (JSON list
of :class:`ShufflerEntry`: id, the URL its signed descriptor is fetched from, and the Ed25519
key pinned for it) or ``ESA_ANALYZER_SHUFFLERS_FILE``. ``admin_token`` guards publishing
releases; placeholder secrets are refused outside ``environment=development``.
``lifetime_delta`` is the total δ of every lifetime ε the ledger states (default
:data:`LIFETIME_DELTA`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from common.collection import parse_key, published_key, verify_descriptor
from common.envelope import inner_size, public_bytes
from common.wire import (
    PART_FRAGMENTS,
    ChannelConfig,
    DeviceBudget,
    ShufflerEntry,
    SignedDescriptor,
    b64,
)
from runtime import failpoints
from runtime.cors import CorsSettings
from runtime.deadlines import DeadlineSettings
from runtime.keys import Timing, key_timing, overlap_floor
from runtime.proxies import TrustedProxySettings
from runtime.secrets import SecretFileSettings, refuse_placeholder

#: Settings that may be given as files (``ESA_ANALYZER_<NAME>_FILE``: Docker secrets).
_SECRETS = ("admin_token", "metrics_token", "database_url")
#: Default lifetime δ of every lifetime ε the ledger states: δ well below 1/n for deployments up
#: to 10^6 devices (Dwork & Roth, *The Algorithmic Foundations of DP*, §2.3: δ << 1/n); the
#: accounting reference example states its lifetime at 1e-5.
LIFETIME_DELTA = 1e-6
#: Beyond the shortest safe overlap of a replaced HPKE key, the time its fragments may still
#: spend reaching the analyzer and waiting to be opened (a shuffler's forwarding retries, an
#: analyzer outage).
DELIVERY_ALLOWANCE = 24 * 3600.0
#: A shuffler's grace after an epoch ends (its ``epoch_grace_seconds``, 2 s by default), with
#: room to spare.
EPOCH_GRACE_ALLOWANCE = 60.0
#: Bytes of a batch part besides its fragments: the JSON keys and the longest ids and numbers
#: they can hold (< 500 bytes), with room to spare.
PART_HEADER_BYTES = 4096


def largest_part_bytes(channels: list[ChannelConfig]) -> int:
    """The largest legal batch part body: :data:`~common.wire.PART_FRAGMENTS` fragments of the
    channel with the largest sealed fragment, each a JSON string of base64 (4 characters per 3
    bytes, two quotes and a comma), plus :data:`PART_HEADER_BYTES`. With the default channels
    (payload size 16, 72-byte sealed fragments) it is 4.95 MB."""
    payload = max((c.payload_size for c in channels), default=16)
    encoded = 4 * -(-inner_size(payload) // 3) + 3
    return PART_FRAGMENTS * encoded + PART_HEADER_BYTES


def _pinned(entry: ShufflerEntry) -> ShufflerEntry:
    """A registry entry with the key it pins: its ``signing_key``, or the key of the descriptor
    the shuffler published at ``descriptor_file`` (which must name the same shuffler and, with
    a ``signing_key``, descend from it through its successions)."""
    if entry.descriptor_file is None:
        if not entry.signing_key:
            raise ValueError(f"shuffler {entry.id!r}: give signing_key or descriptor_file")
        return entry
    path = Path(entry.descriptor_file)
    try:
        document = SignedDescriptor.model_validate_json(path.read_text())
        named, key = published_key(document)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"shuffler {entry.id!r}: its published descriptor {path} is unusable ({error}); "
            "is the shuffler started?"
        ) from error
    pinned = entry.signing_key or b64(public_bytes(key))
    try:
        verify_descriptor(document, parse_key(pinned, f"shuffler {entry.id!r}"), None)
    except ValueError as error:
        raise ValueError(f"shuffler {entry.id!r}: {path} describes another key: {error}") from error
    if named != entry.id:
        raise ValueError(f"shuffler {entry.id!r}: {path} describes {named!r}")
    return entry.model_copy(update={"signing_key": pinned, "descriptor": document})


def _listed(path: Path, key: str) -> list[Any]:
    data = json.loads(path.read_text())
    return list(data.get(key, data) if isinstance(data, dict) else data)


#: Settings that were renamed, old name to new: refused at start, never silently ignored.
RENAMED = {"intake_slots": "intake_slots_per_shuffler"}


class AnalyzerSettings(SecretFileSettings, DeadlineSettings, TrustedProxySettings, CorsSettings):
    """Everything the analyzer needs; validated at start (the request deadlines of
    :class:`runtime.deadlines.DeadlineSettings`, the ``trusted_proxies`` of
    :class:`runtime.proxies.TrustedProxySettings` and the ``cors_origins`` of
    :class:`runtime.cors.CorsSettings` included)."""

    model_config = SettingsConfigDict(env_prefix="ESA_ANALYZER_", env_file=".env", extra="ignore")
    secret_fields: ClassVar[tuple[str, ...]] = _SECRETS

    environment: Literal["development", "production"] = "development"
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=1, le=65535)
    public_url: str | None = None
    database_url: str = "sqlite:///var/analyzer/analyzer.db"
    key_dir: Path = Path("var/keys/analyzer")
    #: Where to publish ``analyzer.pub`` (its config-signing key, base64) at start, for the
    #: other parties and app builders to pin; none: not published.
    publish_dir: Path | None = None
    #: Training state, one JSON file per training channel (LDP-SGD; :mod:`analyzer.training`).
    training_dir: Path = Path("var/analyzer/training")
    channels: list[ChannelConfig] = Field(default_factory=list)
    channels_file: Path | None = None
    shufflers: list[ShufflerEntry] = Field(default_factory=list)
    shufflers_file: Path | None = None
    config_ttl_seconds: int = Field(7 * 24 * 3600, ge=60)
    #: How often each replica reads the channel log for channels another replica added or
    #: retired (a change made at a replica is served by it at once).
    channel_refresh_seconds: float = Field(2.0, gt=0)
    #: How often each shuffler's signed descriptor is fetched again (sooner while one is
    #: missing); a descriptor's own validity is the shuffler's ``descriptor_ttl_seconds``.
    descriptor_refresh_seconds: float = Field(60.0, gt=0)
    #: Whole-request deadline of one descriptor fetch (each shuffler is fetched in a thread
    #: of its own, so one answering slowly delays no other's).
    descriptor_fetch_deadline_seconds: float = Field(5.0, gt=0, le=60)
    #: How far ahead of this analyzer's clock the epoch a batch names may start (the parties'
    #: clock skew): a batch for a later epoch is refused (422 ``future_epoch``).
    epoch_skew_seconds: float = Field(300.0, ge=0, le=86400)
    #: How often each replica reads its key directory (``keys.json``): a rotation made at one
    #: replica reaches the others within this time.
    key_reload_seconds: float = Field(10.0, gt=0)
    #: How long a new key is pending (loaded, not published): at least twice
    #: ``key_reload_seconds``, so every replica opens what is sealed to it before devices do.
    key_activation_seconds: float = Field(60.0, gt=0)
    #: How long a replaced HPKE key still opens fragments; default (None): the shortest that
    #: loses nothing (``config_ttl_seconds`` + clock skew + the longest epoch + grace,
    #: :func:`runtime.keys.overlap_floor`) plus :data:`DELIVERY_ALLOWANCE`; a shorter one is
    #: refused.
    hpke_overlap_seconds: float | None = Field(None, gt=0)
    #: Largest batch part body read before its signature is checked; default (None): the
    #: largest legal part of the configured channels (:func:`largest_part_bytes`).
    max_batch_bytes: int | None = Field(None, ge=1024)
    #: How long the parts of a batch that never completes are kept after its last part
    #: arrived (longer than a shuffler's retention, which purges the rest of such a batch).
    incomplete_retention_seconds: float = Field(14 * 24 * 3600.0, gt=0)
    #: How long after an epoch's end its (channel, crowd) groups are closed for good when not
    #: every shuffler serving the channel delivered a batch for it (one held its group below
    #: ``min_crowd``, had no contributions, or is down): releases then rest on the batches
    #: complete at the close, and a batch completing later is never released. An epoch every
    #: shuffler delivered for is released at once. Until one or the other, the epoch is left out
    #: of every release, so no release changes by one shuffler's batch.
    epoch_close_seconds: float = Field(3600.0, ge=0)
    #: How often each replica looks for groups whose close timeout has passed.
    epoch_close_poll_seconds: float = Field(5.0, gt=0)
    #: Batch parts read at once, per registered shuffler, before their signature is checked
    #: (beyond: 503 ``busy``; :class:`analyzer.slots.IntakeSlots`); only a request whose
    #: ``ESA-Preauth`` head the shuffler signed takes one, and one shuffler's parts never take
    #: another's. Reads in progress hold at most this many largest parts per registered
    #: shuffler in each worker process. Each replica's forwarder sends one part at a time.
    intake_slots_per_shuffler: int = Field(2, ge=1, le=64)
    admin_token: SecretStr = SecretStr("development")
    #: Bearer token for ``GET /metrics`` (none: open, as on a loopback deployment; set it
    #: where the metrics port is reachable, so one party's operator does not read another's).
    metrics_token: SecretStr | None = None
    lifetime_delta: float = Field(LIFETIME_DELTA, gt=0, lt=1)
    #: Per-device local-ε cap over all channels, signed into the collection config and
    #: enforced by the SDK (JSON, e.g. ``{"lifetime_eps": 40}``); per-channel caps are the
    #: channels' own ``budget``.
    device_budget: DeviceBudget | None = None
    log_level: str = "INFO"
    #: Processes that open stored batch parts (HPKE opening is the bottleneck; 1
    #: opens in the service process itself).
    opening_processes: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    #: Fragments one opening task handles (a pool round trip costs ~1 ms; ~2,000 HPKE opens
    #: take ~0.1 s, so the overhead stays near 1%).
    opening_chunk: int = Field(2000, ge=1)
    #: How often the opener looks for stored parts when nothing wakes it.
    opening_poll_seconds: float = Field(1.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        """Refuse a setting that was renamed (:data:`RENAMED`) rather than ignore it: its
        value would silently not apply (unknown settings are ignored)."""
        given = set(data) if isinstance(data, dict) else set()
        for old, new in RENAMED.items():
            variable = f"ESA_ANALYZER_{old.upper()}"
            if old in given or variable in os.environ:
                raise ValueError(
                    f"{variable} ({old}) was renamed: set ESA_ANALYZER_{new.upper()} ({new}) "
                    "instead, and remove the old one"
                )
        return data

    @model_validator(mode="after")
    def _load(self) -> AnalyzerSettings:
        if self.channels_file is not None:
            self.channels = [ChannelConfig(**c) for c in _listed(self.channels_file, "channels")]
        if self.shufflers_file is not None:
            self.shufflers = [ShufflerEntry(**s) for s in _listed(self.shufflers_file, "shufflers")]
        self.shufflers = [_pinned(entry) for entry in self.shufflers]
        for name, ids in (
            ("channel", [c.id for c in self.channels]),
            ("shuffler", [s.id for s in self.shufflers]),
        ):
            if len(ids) != len(set(ids)):
                raise ValueError(f"duplicate {name} ids in {ids}")
        failpoints.refuse_in_production(self.environment)
        refuse_placeholder("admin_token", self.admin_token.get_secret_value(), self.environment)
        if self.metrics_token is not None:
            token = self.metrics_token.get_secret_value()
            refuse_placeholder("metrics_token", token, self.environment)
        return self

    @model_validator(mode="after")
    def _check_keys(self) -> AnalyzerSettings:
        self.key_timing(self.channels)
        return self

    def key_timing(self, channels: Sequence[ChannelConfig]) -> Timing:
        """The windows of a rotation with ``channels`` configured (:func:`runtime.keys.key_timing`).

        Raises:
            ValueError: windows that could lose what devices sealed.
        """
        longest = max((c.epoch_seconds for c in channels), default=0)
        floor = overlap_floor(self.config_ttl_seconds, longest, EPOCH_GRACE_ALLOWANCE)
        return key_timing(
            self.key_reload_seconds,
            self.key_activation_seconds,
            self.hpke_overlap_seconds,
            floor,
            DELIVERY_ALLOWANCE,
        )

    @property
    def part_cap(self) -> int:
        """The body cap of ``POST /v1/batches``."""
        return self.max_batch_bytes or largest_part_bytes(self.channels)

    @property
    def url(self) -> str:
        """Where clients reach the analyzer."""
        return self.public_url or f"http://{self.host}:{self.port}"
