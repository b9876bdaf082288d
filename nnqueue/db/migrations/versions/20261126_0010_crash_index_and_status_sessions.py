"""engine crashes per key; status-page sessions

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 14:00:00.000000

A partial index of the jobs that crashed an engine, by API key and end time: admission reads a key's last
crashes at each of its submissions (the crash cool-down). And the status page's sessions, so that its cookie
holds a session id rather than the API key.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_engine_crashes",
        "jobs",
        ["api_key_id", "finished_at"],
        postgresql_where=sa.text("error_type = 'EngineCrash'"),
        sqlite_where=sa.text("error_type = 'EngineCrash'"),
    )
    op.create_table(
        "status_sessions",
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id_hash"),
    )
    op.create_index(op.f("ix_status_sessions_api_key_id"), "status_sessions", ["api_key_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_status_sessions_api_key_id"), table_name="status_sessions")
    op.drop_table("status_sessions")
    op.drop_index("ix_jobs_engine_crashes", table_name="jobs")
