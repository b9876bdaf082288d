"""jobs api key id

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 07:31:41.273739
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("api_key_id", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_api_key_id_status", "jobs", ["api_key_id", "status"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_api_key_id_status", table_name="jobs")
    op.drop_column("jobs", "api_key_id")
