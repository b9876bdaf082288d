"""jobs result digests

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 14:00:00.000000

The sha256 of a job's result as the worker uploaded it, and its safetensors copy's size and sha256: the API
returns them and clients check downloads against them (a result changed in the store is detected).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("result_safetensors_size", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("result_safetensors_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_safetensors_sha256")
        batch.drop_column("result_safetensors_size")
        batch.drop_column("result_sha256")
