"""The analyzer's keys and the signed collection config devices fetch (PROTOCOL.md,
"Collection config").

The config names the live HPKE keys newest first (the current key, then ``hpke-previous.pem``
while a rotation is under way, so fragments sealed to either still open), carries each
shuffler's own signed descriptor unchanged, and is signed with the analyzer's Ed25519 key over
its canonical bytes (:func:`common.collection.sign_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from analyzer.settings import AnalyzerSettings
from common.collection import sign_config
from common.envelope import (
    KeyRing,
    key_id,
    load_or_create_ed25519,
    load_or_create_x25519,
    public_bytes,
)
from common.wire import (
    AnalyzerInfo,
    ChannelConfig,
    CollectionConfig,
    HpkeKey,
    SignedConfig,
    SignedDescriptor,
    b64,
)


@dataclass(frozen=True)
class AnalyzerKeys:
    """The live HPKE keys (newest first) and the config signing key."""

    hpke: tuple[X25519PrivateKey, ...]
    signing: Ed25519PrivateKey

    @classmethod
    def load(cls, key_dir: Path) -> AnalyzerKeys:
        """Keys from ``key_dir`` (``hpke.pem`` and ``signing.pem`` are created if missing)."""
        live = [load_or_create_x25519(key_dir / "hpke.pem")]
        previous = key_dir / "hpke-previous.pem"
        if previous.exists():
            live.append(load_or_create_x25519(previous))
        return cls(tuple(live), load_or_create_ed25519(key_dir / "signing.pem"))

    def ring(self) -> KeyRing:
        """The keys fragments are opened with."""
        return KeyRing.of(*self.hpke)


def collection_config(
    settings: AnalyzerSettings,
    keys: AnalyzerKeys,
    now: int,
    shufflers: list[SignedDescriptor],
    channels: list[ChannelConfig] | None = None,
    revision: int = 0,
) -> CollectionConfig:
    """The config devices need, valid for ``config_ttl_seconds`` from ``now``: the shufflers'
    own signed descriptors, and ``channels`` as published (e.g. with a training channel's
    current model)."""
    analyzer = AnalyzerInfo(
        url=settings.url,
        keys=[
            HpkeKey(
                key_id=key_id(k.public_key()).hex(), public_key=b64(public_bytes(k.public_key()))
            )
            for k in keys.hpke
        ],
        signing_key=b64(public_bytes(keys.signing.public_key())),
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
    """``GET /v1/config``: the collection config signed with the analyzer's Ed25519 key."""
    config = collection_config(settings, keys, now, shufflers, channels, revision)
    return sign_config(config, keys.signing)
