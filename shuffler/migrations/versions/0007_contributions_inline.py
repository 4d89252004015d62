"""PostgreSQL keeps a contribution's row whole in its table page (``toast_tuple_target``
8160, the most a page holds): a k-RAPPOR contribution's packed fragments (~2 KB of ciphertext)
put the row just over the 2 KB at which the server otherwise tries pglz on the fragments
(in vain: ciphertext does not compress) and then moves them to the TOAST table, a second
table and index written per contribution.
``benchmarks/postgres_bytea.py`` on this machine: ~50 -> ~39 µs of server CPU per row inserted
in transactions of 51.
A row over a page is still moved out of line.
SQLite is unchanged.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE contributions SET (toast_tuple_target = 8160)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE contributions RESET (toast_tuple_target)")
