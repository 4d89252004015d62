"""The quota is one contribution per (client, channel, epoch), whatever crowd it names
(docs/protocol.md, "Channels, epochs and crowds"): ``uq_contribution_quota`` loses ``crowd_id``.

Before this revision a client could store one contribution per crowd it made up. Of the
contributions stored that way, the first (lowest id) of each (client, channel, epoch) is kept;
the others are deleted and recorded in ``purges`` (reason ``quota``), so every acknowledged
contribution stays accounted for. Downgrading only loosens the constraint again.

Revision ID: 0003
Revises: 0002
"""

import time

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

#: Contributions beyond the first of a (client, channel, epoch): the ones the new quota refuses.
_EXTRA = (
    "SELECT c.id FROM contributions c WHERE EXISTS (SELECT 1 FROM contributions f "
    "WHERE f.client_id = c.client_id AND f.channel_id = c.channel_id AND f.epoch = c.epoch "
    "AND f.id < c.id)"
)


def _constraint(columns: list[str]) -> None:
    with op.batch_alter_table("contributions") as batch:
        batch.drop_constraint("uq_contribution_quota", type_="unique")
        batch.create_unique_constraint("uq_contribution_quota", columns)


def upgrade() -> None:
    bind = op.get_bind()
    extra = bind.execute(sa.text(f"SELECT count(*) FROM ({_EXTRA}) AS extra")).scalar_one()
    if extra:
        bind.execute(sa.text(f"DELETE FROM contributions WHERE id IN ({_EXTRA})"))
        bind.execute(
            sa.text(
                "INSERT INTO purges (reason, contributions, purged_at) "
                "VALUES ('quota', :extra, :now)"
            ),
            {"extra": extra, "now": time.time()},
        )
    _constraint(["client_id", "channel_id", "epoch"])


def downgrade() -> None:
    _constraint(["client_id", "channel_id", "crowd_id", "epoch"])
