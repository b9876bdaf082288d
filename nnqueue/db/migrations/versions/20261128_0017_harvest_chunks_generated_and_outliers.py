"""harvest chunks: generated rows and outliers

Revision ID: 0017
Revises: 0015
Create Date: 2026-11-28 12:00:00.000000

Each completed chunk keeps how many of its shard's rows are of generated tokens, and, for a harvest whose spec
drops or clips outlier rows, the limits its writer used, each capture's rows over them and the rows dropped; the
manifest adds them up. Both null for chunks completed before.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("harvest_chunks", sa.Column("generated_rows", sa.BigInteger(), nullable=True))
    op.add_column("harvest_chunks", sa.Column("outliers", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("harvest_chunks", "outliers")
    op.drop_column("harvest_chunks", "generated_rows")
