"""harvests, chunks and schedules; workers publish their capture points

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 14:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("capture_points", sa.JSON(), nullable=True))
    op.create_table(
        "harvest_schedules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("cron", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("next_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_run_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_harvest_id", sa.Uuid(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_harvest_schedules")),
    )
    op.create_index(op.f("ix_harvest_schedules_next_run_at"), "harvest_schedules", ["next_run_at"], unique=False)
    op.create_index(op.f("ix_harvest_schedules_owner"), "harvest_schedules", ["owner"], unique=False)

    op.create_table(
        "harvests",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("model_key", sa.String(length=500), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "completed",
                "failed",
                "cancelled",
                name="harvest_status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("dataset_key", sa.String(length=1024), nullable=False),
        sa.Column("dataset_digest", sa.String(length=64), nullable=False),
        sa.Column("prompts", sa.Integer(), nullable=False),
        sa.Column("chunks_total", sa.Integer(), nullable=False),
        sa.Column("schedule_id", sa.Integer(), nullable=True),
        sa.Column("manifest_key", sa.String(length=1024), nullable=True),
        sa.Column("error_type", sa.String(length=200), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_harvests")),
    )
    op.create_index(op.f("ix_harvests_model_key"), "harvests", ["model_key"], unique=False)
    op.create_index("ix_harvests_owner_created_at", "harvests", ["owner", "created_at"], unique=False)
    op.create_index(op.f("ix_harvests_schedule_id"), "harvests", ["schedule_id"], unique=False)
    op.create_index(op.f("ix_harvests_status"), "harvests", ["status"], unique=False)

    op.create_table(
        "harvest_chunks",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("harvest_id", sa.Uuid(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("model_key", sa.String(length=500), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "completed",
                "failed",
                "cancelled",
                name="harvest_chunk_status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("first_prompt", sa.Integer(), nullable=False),
        sa.Column("prompts", sa.Integer(), nullable=False),
        sa.Column("dataset_start", sa.BigInteger(), nullable=False),
        sa.Column("dataset_end", sa.BigInteger(), nullable=False),
        sa.Column("shard_key", sa.String(length=1024), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=200), nullable=True),
        sa.Column("rows", sa.BigInteger(), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("offsets", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["harvest_id"], ["harvests.id"], name=op.f("fk_harvest_chunks_harvest_id_harvests"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_harvest_chunks")),
    )
    op.create_index("ix_harvest_chunks_harvest_id_index", "harvest_chunks", ["harvest_id", "index"], unique=True)
    op.create_index("ix_harvest_chunks_model_key_status", "harvest_chunks", ["model_key", "status"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_harvest_chunks_model_key_status", table_name="harvest_chunks")
    op.drop_index("ix_harvest_chunks_harvest_id_index", table_name="harvest_chunks")

    op.drop_table("harvest_chunks")
    op.drop_index(op.f("ix_harvests_status"), table_name="harvests")
    op.drop_index(op.f("ix_harvests_schedule_id"), table_name="harvests")
    op.drop_index("ix_harvests_owner_created_at", table_name="harvests")
    op.drop_index(op.f("ix_harvests_model_key"), table_name="harvests")

    op.drop_table("harvests")
    op.drop_index(op.f("ix_harvest_schedules_owner"), table_name="harvest_schedules")
    op.drop_index(op.f("ix_harvest_schedules_next_run_at"), table_name="harvest_schedules")

    op.drop_table("harvest_schedules")
    op.drop_column("workers", "capture_points")
