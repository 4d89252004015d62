"""The analyzer's tables (SQLAlchemy Core; created by the alembic migrations in
``analyzer/migrations``).

``batch_parts`` (the raw part until opened, then its counts; ``quarantined`` after
:data:`analyzer.opening.OPEN_ATTEMPTS` failed openings), ``open_batches``, ``receipts`` (claimed
and verified crowd; ``withheld`` below ``min_crowd``), ``accumulators`` per (channel, crowd,
epoch, shuffler), ``epoch_charges`` (the privacy ledger: one row per (channel, crowd, epoch),
rewritten under its lock with every batch), ``epoch_closures`` (groups closed at their
timeout), ``shuffler_descriptors``, ``channel_changes`` and ``releases``; ``seen_epochs`` and
``seen_parts`` (each sealed fragment counted once) are :mod:`analyzer.seen`'s.

What each table holds and why: docs/architecture.md, "Analyzer internals".
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    false,
)

metadata = MetaData()

receipts = Table(
    "receipts",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("shuffler_id", String(64), nullable=False),
    Column("channel_id", String(64), nullable=False, index=True),
    Column("crowd_id", String(255), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("n_contributions", Integer, nullable=False),
    Column("n_fragments", Integer, nullable=False),
    Column("invalid", Integer, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("n_verified", Integer, nullable=True),
    Column("withheld", Boolean, nullable=False, server_default=false()),
)

accumulators = Table(
    "accumulators",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("crowd_id", String(255), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("shuffler_id", String(64), primary_key=True),
    Column("state", LargeBinary, nullable=False),
    Column("batches", Integer, nullable=False),
)

releases = Table(
    "releases",
    metadata,
    Column(
        "id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("channel_id", String(64), nullable=False, index=True),
    Column("epoch_from", BigInteger, nullable=False),
    Column("epoch_to", BigInteger, nullable=False),
    Column("n", Integer, nullable=False),
    Column("certificate", Text, nullable=False),
    Column("summary", Text, nullable=False),
    Column("released_at", Float, nullable=False),
)

epoch_charges = Table(
    "epoch_charges",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("crowd_id", String(255), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("certificate", Text, nullable=False),
    Column("batches", Integer, nullable=False),
    Column("charged_at", Float, nullable=False),
)

batch_parts = Table(
    "batch_parts",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("part", Integer, primary_key=True),
    Column("parts", Integer, nullable=False),
    Column("shuffler_id", String(64), nullable=False),
    Column("channel_id", String(64), nullable=False),
    Column("crowd_id", String(255), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("n_contributions", Integer, nullable=False),
    Column("n_fragments", Integer, nullable=False),
    Column("body", LargeBinary, nullable=True),
    Column("status", String(16), nullable=False, index=True),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text, nullable=True),
    Column("invalid", Integer, nullable=False),
    Column("received_at", Float, nullable=False),
    Column("n_opened", Integer, nullable=True),
    Index("ix_batch_parts_group", "shuffler_id", "channel_id", "crowd_id", "epoch"),
)

shuffler_descriptors = Table(
    "shuffler_descriptors",
    metadata,
    Column("shuffler_id", String(64), primary_key=True),
    Column("issued_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("document", Text, nullable=False),
)

#: The channels added and retired at runtime, as a log whose ``version`` numbers the configs.
channel_changes = Table(
    "channel_changes",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=True),
    Column("channel_id", String(64), nullable=False),
    Column("action", String(16), nullable=False),
    Column("config", Text, nullable=True),
    Column("retired_from_epoch", BigInteger, nullable=True),
    Column("changed_at", Float, nullable=False),
    Index("ix_channel_changes_channel", "channel_id"),
)

#: The groups closed for good at their timeout
#: (:meth:`analyzer.store.AnalyzerStore.close_group`): the shufflers whose batches their
#: releases rest on, as a sorted JSON list.
epoch_closures = Table(
    "epoch_closures",
    metadata,
    Column("channel_id", String(64), primary_key=True),
    Column("crowd_id", String(255), primary_key=True),
    Column("epoch", BigInteger, primary_key=True),
    Column("shufflers", Text, nullable=False),
    Column("closed_at", Float, nullable=False),
)

#: ``channel_changes.action``.
ADD, RETIRE = "add", "retire"
#: ``batch_parts.status``: waiting for the opener, folded in, or set aside after failed openings.
STORED, OPENED, QUARANTINED = "stored", "opened", "quarantined"

open_batches = Table(
    "open_batches",
    metadata,
    Column("batch_id", String(32), primary_key=True),
    Column("state", LargeBinary, nullable=False),
    Column("opened", Integer, nullable=False),
    Column("n_fragments", Integer, nullable=False),
    Column("invalid", Integer, nullable=False),
)
