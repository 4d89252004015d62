"""``batch_parts.n_opened``: how many of an opened part's fragments opened (decrypted), written
in the same ``UPDATE`` that marks the part ``opened`` (so exactly once, whichever analyzer
worker folded it). The database already kept a part's fragments (``n_fragments``) and the ones
that failed to open or parse (``invalid``), but not the undecryptable ones apart from the
unparsable ones, so "fragments opened" (what ``esa_analyzer_fragments_opened_total`` counts in
one process) could not be read back from the database for every worker together.

Existing rows are left NULL (adding a nullable column rewrites nothing): a part opened before
this revision counts ``n_fragments - invalid`` as opened
(:meth:`analyzer.store.AnalyzerStore.fragment_ledger`).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batch_parts") as batch:
        batch.add_column(sa.Column("n_opened", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_parts") as batch:
        batch.drop_column("n_opened")
