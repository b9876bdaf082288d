"""workers containment

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 14:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # What the worker's engine processes run under (nnqueue.isolation.Containment.report); null for workers
    # registered before this revision.
    op.add_column("workers", sa.Column("containment", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "containment")
