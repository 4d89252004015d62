"""Shuffler settings: environment variables ``ESA_SHUFFLER_*`` (or a ``.env`` file).

Channels come from ``ESA_SHUFFLER_CHANNELS`` (a JSON list of :class:`ChannelPolicy`) or
``ESA_SHUFFLER_CHANNELS_FILE`` (a JSON file with that list, or with an analyzer collection
config's ``channels``). Placeholder secrets are refused outside ``environment=development``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from common.wire import PART_FRAGMENTS, ChannelPolicy
from runtime import failpoints
from runtime.cors import CorsSettings
from runtime.deadlines import DeadlineSettings
from runtime.keys import Timing, key_timing, overlap_floor
from runtime.proxies import TrustedProxySettings
from runtime.secrets import SecretFileSettings, refuse_placeholder

#: Bind addresses that name no reachable host (a descriptor cannot vouch for them).
WILDCARDS = frozenset({"0.0.0.0", "::", "", "[::]"})
#: Beyond the shortest safe overlap of a replaced HPKE key, a margin (clocks, a slow reload).
OVERLAP_MARGIN = 3600.0
#: Settings that may be given as files (``ESA_SHUFFLER_<NAME>_FILE``: Docker secrets).
_SECRETS = ("token_secret", "admin_token", "metrics_token", "database_url")


class ShufflerSettings(SecretFileSettings, DeadlineSettings, TrustedProxySettings, CorsSettings):
    """Everything a shuffler instance needs; validated at start (the request deadlines of
    :class:`runtime.deadlines.DeadlineSettings`, the ``trusted_proxies`` of
    :class:`runtime.proxies.TrustedProxySettings` and the ``cors_origins`` of
    :class:`runtime.cors.CorsSettings` included)."""

    model_config = SettingsConfigDict(env_prefix="ESA_SHUFFLER_", env_file=".env", extra="ignore")
    secret_fields: ClassVar[tuple[str, ...]] = _SECRETS

    shuffler_id: str = "shuffler-1"
    environment: Literal["development", "production"] = "development"
    host: str = "127.0.0.1"
    port: int = Field(8101, ge=1, le=65535)
    #: The URL devices send to, vouched for in this shuffler's signed descriptor (default
    #: ``http://<host>:<port>``; behind HAProxy or a public name, set it to that).
    public_url: str | None = None
    #: How long a signed descriptor stays valid: devices refuse an expired one, so the analyzer
    #: must fetch a fresh one within this time (it refreshes every minute).
    descriptor_ttl_seconds: int = Field(7 * 24 * 3600, ge=60)
    #: How often each replica reads its key directory (``keys.json``), from its batching round
    #: (so at most every ``batch_interval_seconds``): a rotation made at one replica reaches the
    #: others within this time; a contribution sealed to a key a replica does not hold yet makes
    #: it read the directory at once.
    key_reload_seconds: float = Field(10.0, gt=0)
    #: How long a new key is pending (loaded, not published): at least twice
    #: ``key_reload_seconds``, so every replica opens what is sealed to it before devices do.
    key_activation_seconds: float = Field(60.0, gt=0)
    #: How long a replaced HPKE key still opens contributions; default (None): the shortest
    #: that loses nothing (``descriptor_ttl_seconds`` + clock skew + the longest epoch +
    #: ``epoch_grace_seconds``, :func:`runtime.keys.overlap_floor`) plus an hour; a shorter one
    #: is refused. After it, a contribution sealed to the key gets 409 ``config_outdated``.
    hpke_overlap_seconds: float | None = Field(None, gt=0)
    database_url: str = "sqlite:///var/shuffler-1/shuffler.db"
    #: Where to publish ``<shuffler_id>.descriptor.json`` (its signed descriptor) at start, for
    #: the analyzer's registry and app builders to pin its key; none: not published.
    publish_dir: Path | None = None
    key_dir: Path = Path("var/keys/shuffler-1")
    analyzer_url: str | None = None
    #: The analyzer's config-signing key this shuffler pins (base64 Ed25519), or the file the
    #: analyzer publishes it in (``analyzer.pub``, read at each fetch until it exists): with
    #: either, channels added and retired at the analyzer are adopted from its signed config.
    analyzer_key: str | None = None
    analyzer_key_file: Path | None = None
    #: How often the analyzer's signed config is fetched for channel changes (sooner when a
    #: contribution names a channel not served yet).
    config_refresh_seconds: float = Field(10.0, gt=0)
    #: Whole-request deadline of one fetch of the analyzer's config (however slowly it
    #: answers, the follower tries again at its next refresh).
    config_fetch_deadline_seconds: float = Field(5.0, gt=0, le=60)
    #: The weakest randomized deletion this shuffler applies to a channel it adopts from the
    #: analyzer's config (the channels of its own settings are the operator's choice): a new
    #: channel below it is refused, so an analyzer cannot switch deletion off.
    adopt_min_crowd: int = Field(10, ge=1)
    adopt_max_eps_cr: float = Field(2.0, gt=0)
    adopt_max_delta_cr: float = Field(1e-5, gt=0, lt=1)
    #: The largest local ε (replacement notion: ESA-revisited's ε0, what amplification by
    #: shuffling starts from) and certificate δ of a channel this shuffler adopts; a channel
    #: whose mechanism claims no local privacy at all (all of its privacy from the shuffle,
    #: e.g. Balcer–Cheu's zero-sum histogram) is adopted only with ``adopt_without_local_privacy``.
    adopt_max_local_eps: float = Field(12.0, gt=0)
    adopt_max_delta: float = Field(1e-5, gt=0, lt=1)
    adopt_without_local_privacy: bool = True
    token_secret: SecretStr = SecretStr("development")
    admin_token: SecretStr = SecretStr("development")
    #: Bearer token for ``GET /metrics`` (exact pending/held/deleted counts are secret until
    #: released: docs/protocol.md); the admin token when not set.
    metrics_token: SecretStr | None = None
    channels: list[ChannelPolicy] = Field(default_factory=list)
    channels_file: Path | None = None
    max_body_bytes: int = Field(256 * 1024, ge=1024)
    #: Per-client token bucket, kept in each process's memory: with R replicas per trust
    #: domain the limit holds per replica. Behind ``esa up``'s HAProxy (balancing on the
    #: client token) a client reaches one replica, so it holds as set; a balancer that sprays
    #: requests lets a client send up to R times it (docs/scaling.md).
    rate_per_second: float = Field(5.0, gt=0)
    rate_burst: int = Field(20, ge=1)
    enroll_per_minute: float = Field(600.0, gt=0)
    epoch_grace_seconds: float = Field(2.0, ge=0)
    #: How long before the next epoch starts a contribution for it is taken (a device whose
    #: clock is ahead by up to this); one for a later epoch is refused (400 ``epoch_not_open``).
    epoch_skew_seconds: float = Field(300.0, ge=0, le=3600)
    batch_interval_seconds: float = Field(1.0, gt=0)
    forward_interval_seconds: float = Field(0.5, gt=0)
    #: Fragments per signed batch part: bounds every POST to the analyzer (at most the
    #: protocol's :data:`~common.wire.PART_FRAGMENTS`, which the analyzer's body cap is sized for).
    part_fragments: int = Field(PART_FRAGMENTS, ge=1, le=PART_FRAGMENTS)
    #: How long a forwarder holds a part it is sending; longer than one POST may take
    #: (:data:`shuffler.app.ANALYZER_TIMEOUT`), so a live forwarder never loses it.
    forward_lease_seconds: float = Field(120.0, gt=0)
    backoff_base_seconds: float = Field(0.5, gt=0)
    backoff_cap_seconds: float = Field(60.0, gt=0)
    retention_seconds: float = Field(7 * 24 * 3600.0, gt=0)
    commit_batch: int = Field(64, ge=1)
    #: Under load, a group commit waits up to ``commit_wait_seconds`` until as many requests
    #: are queued as in its recent batches, at most ``commit_fill`` (fewer, larger
    #: transactions; :class:`shuffler.ingest.CommitQueue`). An idle service commits at once.
    commit_fill: int = Field(32, ge=1)
    commit_wait_seconds: float = Field(0.010, ge=0, le=1)
    #: How long an ingest commit waits for SQLite's write lock before answering 503: longer
    #: than an epoch close's final step (which removes the group's rows; ~1.2 s for 24,000
    #: contributions on a loaded 2-core machine), shorter than the SDK's 10-second timeout.
    sqlite_busy_timeout_seconds: float = Field(8.0, gt=0)
    log_level: str = "INFO"

    @model_validator(mode="after")
    def _load_and_check(self) -> ShufflerSettings:
        if self.channels_file is not None:
            data = json.loads(self.channels_file.read_text())
            listed = data.get("channels", data) if isinstance(data, dict) else data
            fields = set(ChannelPolicy.model_fields)
            self.channels = [
                ChannelPolicy(**{k: v for k, v in c.items() if k in fields}) for c in listed
            ]
        failpoints.refuse_in_production(self.environment)
        for name in ("token_secret", "admin_token", "metrics_token"):
            value = getattr(self, name)
            if value is not None:
                refuse_placeholder(name, value.get_secret_value(), self.environment)
        if self.public_url is None and self.host in WILDCARDS:
            raise ValueError(
                f"host={self.host} listens on every address: set public_url to the URL devices "
                "reach this shuffler at (its signed descriptor vouches for it)"
            )
        if self.analyzer_key is not None and self.analyzer_key_file is not None:
            raise ValueError("give analyzer_key or analyzer_key_file, not both")
        if self.follows_analyzer and self.analyzer_url is None:
            raise ValueError("following the analyzer's channels needs analyzer_url")
        ids = [c.id for c in self.channels]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate channel ids in {ids}")
        return self

    @model_validator(mode="after")
    def _check_keys(self) -> ShufflerSettings:
        self.key_timing(self.channels)
        return self

    def key_timing(self, channels: Sequence[ChannelPolicy]) -> Timing:
        """The windows of a rotation with ``channels`` served (:func:`runtime.keys.key_timing`).

        Raises:
            ValueError: windows that could lose what devices sealed.
        """
        longest = max((c.epoch_seconds for c in channels), default=0)
        floor = overlap_floor(self.descriptor_ttl_seconds, longest, self.epoch_grace_seconds)
        return key_timing(
            max(self.key_reload_seconds, self.batch_interval_seconds),  # reloaded by the round
            self.key_activation_seconds,
            self.hpke_overlap_seconds,
            floor,
            OVERLAP_MARGIN,
        )

    @property
    def url(self) -> str:
        """Where devices reach this shuffler."""
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def follows_analyzer(self) -> bool:
        """Whether channel changes are adopted from the analyzer's signed config."""
        return self.analyzer_key is not None or self.analyzer_key_file is not None
