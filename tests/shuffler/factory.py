"""Building a shuffler service over a real database for the layer tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from alembic.config import Config
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from sqlalchemy.engine import Connection

from common.envelope import Contribution, KeyRing, new_nonce, seal_contribution
from common.randomness import RandomSource
from common.wire import ChannelPolicy
from runtime import db
from shuffler.app import MIGRATIONS
from shuffler.records import Pending
from shuffler.service import ShufflerService, Stored
from shuffler.settings import ShufflerSettings
from shuffler.store_backends import make_store

EPOCH_SECONDS = 3600
POLICY = ChannelPolicy(
    id="homepage",
    epoch_seconds=EPOCH_SECONDS,
    min_crowd=5,
    eps_cr=1.0,
    delta_cr=1e-3,
    max_fragments=8,
)


class Clock:
    """A settable clock, 100 s into epoch 1,000."""

    def __init__(self) -> None:
        self.now = 1_000 * EPOCH_SECONDS + 100.0

    def __call__(self) -> float:
        return self.now

    @property
    def epoch(self) -> int:
        return int(self.now // EPOCH_SECONDS)


def make_service(
    url: str,
    tmp_path: Path,
    rng: RandomSource | None = None,
    policy: ChannelPolicy = POLICY,
    **overrides: Any,
) -> tuple[ShufflerService, Clock]:
    """A service over a migrated database at ``url`` with a test clock."""
    settings = ShufflerSettings(
        database_url=url, key_dir=tmp_path / "keys", channels=[policy], **overrides
    )
    engine = db.make_engine(url)
    db.upgrade(engine, MIGRATIONS)
    clock = Clock()
    service = ShufflerService(
        settings,
        make_store(engine),
        KeyRing.of(X25519PrivateKey.generate()),
        Ed25519PrivateKey.generate(),
        clock,
        rng,
    )
    return service, clock


def sealed(
    service: ShufflerService,
    epoch: int,
    fragments: int = 2,
    channel: str = "homepage",
    nonce: bytes | None = None,
    tag: int | None = None,
) -> bytes:
    """A contribution sealed for ``service``; with a ``tag``, each of its fragments starts with
    it (4 bytes) and then its index, so a test can tell whose fragment lands where."""
    contribution = Contribution(
        channel_id=channel,
        crowd_id="",
        epoch=epoch,
        nonce=nonce or new_nonce(),
        fragments=tuple(
            bytes([i % 256]) * 72 if tag is None else tag.to_bytes(4, "big") + bytes([i]) * 68
            for i in range(fragments)
        ),
    )
    return seal_contribution(contribution, service.settings.shuffler_id, service.ring.public())


def pending(service: ShufflerService, token: str, epoch: int, **kwargs: object) -> Pending:
    """A validated contribution (not stored)."""
    return service.validate(service.admit(token), sealed(service, epoch, **kwargs))  # type: ignore[arg-type]


def contribute(service: ShufflerService, token: str, epoch: int, **kwargs: object) -> Stored:
    """Validate and commit one contribution."""
    return service.commit([pending(service, token, epoch, **kwargs)])[0]


def fill(service: ShufflerService, epoch: int, count: int) -> None:
    """``count`` accepted contributions from fresh clients."""
    for _ in range(count):
        assert contribute(service, service.tokens.issue(), epoch).receipt


def open_files() -> list[str]:
    """What this process's file descriptors point at (Linux ``/proc``), an unlinked temporary
    file included (``/dir/#123 (deleted)``)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            continue
    return links


def migrations_on(conn: Connection) -> Config:
    """The shuffler's alembic migrations, to run on ``conn`` (inside the caller's
    transaction) with ``alembic.command.upgrade`` / ``downgrade``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    return config
