"""The analyzer's tables (SQLAlchemy Core; created by alembic migrations).

* ``receipts``: one row per accepted batch (idempotency by ``batch_id``), with its crowd size
  and how many fragments were chaff.
* ``accumulators``: the sufficient statistics per (channel, crowd, epoch, shuffler), updated
  in the same transaction as the receipt. Kept per shuffler because each shuffler's batch is
  shuffled separately: its crowd is what certification may rely on.
* ``releases``: the privacy ledger — every estimate served, with its certificate.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
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
    Column("image", LargeBinary, nullable=True),
    Column("released_at", Float, nullable=False),
)
