"""jobs purged at

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("purged_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_jobs_purged_at_finished_at", "jobs", ["purged_at", "finished_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_purged_at_finished_at", table_name="jobs")
    op.drop_column("jobs", "purged_at")
