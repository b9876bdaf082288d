"""job payloads: small payloads kept in the database

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 11:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_payloads",
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_payloads_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_payloads")),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("payload_key", existing_type=sa.String(length=1024), nullable=True)


def downgrade() -> None:
    # The older schema has no place for a payload kept in the database: such jobs keep their rows and history,
    # with a key where no object is (an older worker fails them as PayloadMissing rather than losing them).
    op.execute("UPDATE jobs SET payload_key = 'payloads/' || id WHERE payload_key IS NULL")
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("payload_key", existing_type=sa.String(length=1024), nullable=False)
    op.drop_table("job_payloads")
