"""weights versions

Revision ID: 0014
Revises: 0012
Create Date: 2026-11-26 17:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The weights version a worker serves, since when, and where it came from (nnqueue.workers.weights).
    op.add_column("workers", sa.Column("weights_version", sa.String(200), nullable=True))
    op.add_column("workers", sa.Column("weights_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("workers", sa.Column("weights_source", sa.JSON(), nullable=True))
    # A job's pinned version (null: any) and the version it ran on; the same for harvests and their chunks.
    op.add_column("jobs", sa.Column("weights_pin", sa.String(200), nullable=True))
    op.add_column("jobs", sa.Column("weights_version", sa.String(200), nullable=True))
    op.add_column("harvests", sa.Column("weights_pin", sa.String(200), nullable=True))
    op.add_column("harvest_chunks", sa.Column("weights_pin", sa.String(200), nullable=True))
    op.add_column("harvest_chunks", sa.Column("weights_version", sa.String(200), nullable=True))
    op.create_table(
        "weights_updates",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_key", sa.String(500), nullable=False),
        sa.Column("version", sa.String(200), nullable=False),
        sa.Column("source", sa.String(2048), nullable=False),
        sa.Column("tensors", sa.JSON(), nullable=True),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_weights_updates")),
    )
    op.create_index(op.f("ix_weights_updates_model_key"), "weights_updates", ["model_key"])


def downgrade() -> None:
    op.drop_index(op.f("ix_weights_updates_model_key"), table_name="weights_updates")
    op.drop_table("weights_updates")
    op.drop_column("harvest_chunks", "weights_version")
    op.drop_column("harvest_chunks", "weights_pin")
    op.drop_column("harvests", "weights_pin")
    op.drop_column("jobs", "weights_version")
    op.drop_column("jobs", "weights_pin")
    op.drop_column("workers", "weights_source")
    op.drop_column("workers", "weights_since")
    op.drop_column("workers", "weights_version")
