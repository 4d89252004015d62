"""The shuffler's tables (SQLAlchemy Core; the schema is created by alembic migrations).

``contributions`` (acknowledged, awaiting their group; the client id never leaves the
shuffler), ``groups`` (one row per evaluated group: what randomized deletion did),
``batches``, ``batch_parts`` and ``part_bodies`` (ESA-revisited Algorithm 3's shuffled
sequence cut into signed parts, with their forwarding state and lease), ``purges`` (so every
acknowledged contribution is accounted for), ``closed_epochs`` and ``revoked``. What each
holds and why: docs/shuffler.md, "Tables".
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

contributions = Table(
    "contributions",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("channel_id", String(64), nullable=False),
    Column("crowd_id", String(255), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("client_id", String(64), nullable=False),
    Column("nonce", LargeBinary(16), nullable=False, unique=True),
    Column("fragments", LargeBinary, nullable=False),
    Column("n_fragments", Integer, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("held_part", Integer, nullable=True),
    Column("receipt", String(32), nullable=False, unique=True),
    # The nonce's and the quota's uniqueness: PostgreSQL's schema. On SQLite migration 0007
    # drops both and the writing process checks them (shuffler/uniqueness.py).
    UniqueConstraint("client_id", "channel_id", "epoch", name="uq_contribution_quota"),
    Index("ix_contributions_group", "channel_id", "crowd_id", "epoch", "held_part"),
)

groups = Table(
    "groups",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("crowd_id", String(255), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("part", Integer, primary_key=True),
    Column("status", String(16), nullable=False),
    Column("n", Integer, nullable=False),
    Column("kept", Integer, nullable=False),
    Column("deleted", Integer, nullable=False),
    Column("evaluated_at", Float, nullable=False),
)

batches = Table(
    "batches",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("channel_id", String(64), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("n_contributions", Integer, nullable=False),
    Column("parts", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("forwarded_at", Float, nullable=True),
)

batch_parts = Table(
    "batch_parts",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("part", Integer, primary_key=True),
    Column("signature", Text, nullable=False),
    Column("status", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    Column("next_attempt_at", Float, nullable=False),
    Column("lease_until", Float, nullable=True),
    Column("forwarded_at", Float, nullable=True),
    Column("last_error", Text, nullable=True),
    Index("ix_batch_parts_due", "status", "next_attempt_at"),
)

part_bodies = Table(
    "part_bodies",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("part", Integer, primary_key=True),
    Column("body", LargeBinary, nullable=False),
)

purges = Table(
    "purges",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("reason", String(32), nullable=False),
    Column("contributions", Integer, nullable=False),
    Column("purged_at", Float, nullable=False),
)

closed_epochs = Table(
    "closed_epochs",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("closed_at", Float, nullable=False),
)

revoked = Table(
    "revoked",
    metadata,
    Column("client_id", String(64), primary_key=True),
    Column("revoked_at", Float, nullable=False),
)

#: The channel policies adopted from the analyzer's signed config (:mod:`shuffler.policies`),
#: with the config revision each was adopted at.
followed_channels = Table(
    "followed_channels",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("policy", Text, nullable=False),
    Column("version", Integer, nullable=False),
)

#: The analyzer signing key this shuffler follows (moved along the analyzer's successions).
followed_keys = Table(
    "followed_keys",
    metadata,
    Column("party", String(80), primary_key=True),
    Column("signing_key", Text, nullable=False),
)
