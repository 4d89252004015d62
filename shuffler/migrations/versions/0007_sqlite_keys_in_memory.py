"""SQLite drops the unique indexes on the nonce and on the quota (client, channel, epoch): its
one writing process holds those keys in memory (shuffler/uniqueness.py), because their random
keys made each insert dirty a random page of each index, two thirds of a stored contribution's
CPU. SQLite cannot drop a table's constraints, so the table is rebuilt with its rows.
PostgreSQL keeps both: the replicas of a trust domain share its database.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COLUMNS = (
    "id, channel_id, crowd_id, epoch, client_id, nonce, fragments, n_fragments, received_at, "
    "held_part, receipt"
)
REPEATED_NONCES = (
    "SELECT count(*) FROM (SELECT nonce FROM contributions GROUP BY nonce HAVING count(*) > 1)"
)
GROUP_INDEX = ("ix_contributions_group", ["channel_id", "crowd_id", "epoch", "held_part"])


def _rebuild(name: str, *constraints: sa.Constraint) -> None:
    """``contributions`` again, rows and ids kept, with ``constraints`` besides the receipt's.
    Python's sqlite3 module runs a ``CREATE TABLE`` outside the transaction, so a copy that
    an earlier attempt left behind (a full disk, a kill) is dropped first."""
    op.execute(f"DROP TABLE IF EXISTS {name}")
    op.create_table(
        name,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("channel_id", sa.String(64), nullable=False),
        sa.Column("crowd_id", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("client_id", sa.String(64), nullable=False),
        sa.Column("nonce", sa.LargeBinary(16), nullable=False),
        sa.Column("fragments", sa.LargeBinary, nullable=False),
        sa.Column("n_fragments", sa.Integer, nullable=False),
        sa.Column("received_at", sa.Float, nullable=False),
        sa.Column("held_part", sa.Integer, nullable=True),
        sa.Column("receipt", sa.String(32), nullable=False, unique=True),
        *constraints,
    )
    op.execute(f"INSERT INTO {name} ({COLUMNS}) SELECT {COLUMNS} FROM contributions")
    op.drop_table("contributions")
    op.rename_table(name, "contributions")
    op.create_index(GROUP_INDEX[0], "contributions", GROUP_INDEX[1])


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild("contributions_0007")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        repeated = op.get_bind().execute(sa.text(REPEATED_NONCES)).scalar_one()
        if repeated:
            raise RuntimeError(
                f"{repeated} nonces are stored more than once (a client may reuse its nonce in "
                "a later epoch since 0007): the unique index of 0006 cannot be built; "
                "delete those rows first or stay at 0007"
            )
        _rebuild(
            "contributions_0006",
            sa.UniqueConstraint("nonce"),
            sa.UniqueConstraint("client_id", "channel_id", "epoch", name="uq_contribution_quota"),
        )
