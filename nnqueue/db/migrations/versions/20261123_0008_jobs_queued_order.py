"""jobs queued order index

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 15:00:00.000000

A model's queued jobs in claim order, as a partial index: the claim reads its first entry and a queue position
counts the entries before a job, instead of sorting every queued job of the model (or scanning ended ones).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_queued_order",
        "jobs",
        ["model_key", sa.text("priority DESC"), "queued_at", "id"],
        postgresql_where=sa.text("status = 'queued'"),
        sqlite_where=sa.text("status = 'queued'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_order", table_name="jobs")
