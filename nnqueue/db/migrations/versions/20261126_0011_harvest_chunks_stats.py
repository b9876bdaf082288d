"""harvest chunk statistics

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 14:00:00.000000

Each completed chunk keeps its shard's per-capture statistics (sums, a norm histogram, NaN/Inf counts), which
the manifest adds up: a JSON column, null for chunks completed before.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("harvest_chunks", sa.Column("stats", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("harvest_chunks", "stats")
