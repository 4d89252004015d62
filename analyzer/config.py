"""The analyzer's keys and the signed collection config devices fetch (docs/protocol.md,
"Collection config").

The config names the active HPKE keys newest first (the one devices seal to, then the ones it
replaced while their overlap lasts, so fragments sealed to any of them still open), carries each
shuffler's own signed descriptor unchanged, and is signed with the analyzer's current Ed25519
key over its canonical bytes, with the successions that lead to that key from the first one
(:func:`common.collection.sign_config`). Keys rotate while the analyzer runs
(:class:`AnalyzerKeys`, :mod:`runtime.keys`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.settings import AnalyzerSettings
from common.collection import ANALYZER_KEY_FILE, ANALYZER_PARTY, sign_config
from common.envelope import key_id, public_bytes
from common.wire import (
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    HpkeKey,
    SignedConfig,
    SignedDescriptor,
    Succession,
    b64,
)
from runtime.keys import KeyDirectory, LiveKeys, PartyKeys, checked_timing
from runtime.publish import publish


class AnalyzerKeys(LiveKeys):
    """The analyzer's keys as it uses them (:class:`runtime.keys.LiveKeys`): the published HPKE
    keys, the ring fragments are opened with (pending keys included, so every worker opens what
    is sealed to a key before devices are told to use it), the config signer and its
    successions."""

    @classmethod
    def load(
        cls,
        settings: AnalyzerSettings,
        clock: Callable[[], float] = time.time,
        channels: Callable[[], Sequence[ChannelConfig]] | None = None,
        waiting_since: Callable[[], float | None] = lambda: None,
    ) -> AnalyzerKeys:
        """The keys in ``settings.key_dir`` (``hpke.pem`` and ``signing.pem`` created on first
        use), timed by ``settings`` over ``channels`` (default: the configured ones); with a
        ``publish_dir``, ``analyzer.pub`` is published again whenever the signer changes.

        Raises:
            ValueError: the key directory is unusable (naming the file).
        """
        listed = channels or (lambda: settings.channels)
        keys = cls(
            KeyDirectory(settings.key_dir, ANALYZER_PARTY),
            lambda: settings.key_timing(listed()),
            clock,
            waiting_since,
            settings.key_reload_seconds,
        )
        if settings.publish_dir is not None:
            keys.listeners.append(lambda fresh: publish_key(settings.publish_dir, fresh))
        return keys

    @property
    def hpke(self) -> tuple[X25519PrivateKey, ...]:
        """The active HPKE keys, newest (the one devices seal to) first."""
        return self.current.published_hpke()

    @property
    def signing(self) -> Ed25519PrivateKey:
        """The key that signs the config now."""
        return self.current.signer

    @property
    def successions(self) -> tuple[Succession, ...]:
        """The successions from the analyzer's first signing key to :attr:`signing`."""
        return self.current.successions


def check_key_timing(settings: AnalyzerSettings, channels: Sequence[ChannelConfig]) -> None:
    """Whether the analyzer's keys can still rotate safely while serving ``channels`` (an
    explicit ``hpke_overlap_seconds`` must cover their longest epoch): a channel is added only
    if they can with it.

    Raises:
        KeyTimingError: they cannot (``409 key_timing``).
    """
    checked_timing(lambda: settings.key_timing(channels))


def publish_key(directory: Path | None, keys: PartyKeys) -> None:
    """Publish ``analyzer.pub`` (the config signer, base64) for the other parties and app
    builders to pin."""
    if directory is not None:
        publish(directory, ANALYZER_KEY_FILE, b64(public_bytes(keys.signer.public_key())) + "\n")


def collection_config(
    settings: AnalyzerSettings,
    keys: PartyKeys,
    now: int,
    shufflers: list[SignedDescriptor],
    channels: list[ChannelConfig] | None = None,
    revision: int = 0,
) -> CollectionConfig:
    """The config devices need, valid for ``config_ttl_seconds`` from ``now``: the shufflers'
    own signed descriptors, and ``channels`` as published (e.g. with a training channel's
    current model), with the analyzer's keys as ``keys`` holds them."""
    analyzer = AnalyzerInfo(
        url=settings.url,
        keys=[
            HpkeKey(
                key_id=key_id(k.public_key()).hex(), public_key=b64(public_bytes(k.public_key()))
            )
            for k in keys.published_hpke()
        ],
        signing_key=b64(public_bytes(keys.signer.public_key())),
    )
    return CollectionConfig(
        revision=revision,
        issued_at=now,
        expires_at=now + settings.config_ttl_seconds,
        analyzer=analyzer,
        shufflers=shufflers,
        channels=list(settings.channels) if channels is None else channels,
        device_budget=settings.device_budget,
    )


def signed_config(
    settings: AnalyzerSettings,
    keys: AnalyzerKeys,
    now: int,
    shufflers: list[SignedDescriptor],
    channels: list[ChannelConfig] | None = None,
    revision: int = 0,
) -> SignedConfig:
    """``GET /v1/config``: the collection config signed with the analyzer's current Ed25519
    key, with the successions that lead to it (one snapshot of the keys: they agree)."""
    snapshot = keys.current
    config = collection_config(settings, snapshot, now, shufflers, channels, revision)
    return sign_config(config, snapshot.signer, snapshot.successions)
