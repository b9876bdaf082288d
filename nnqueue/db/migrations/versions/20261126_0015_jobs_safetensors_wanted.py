"""jobs: whether the submitter asked for a safetensors copy of the result

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 22:55:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Jobs accepted before this revision were promised both files: they keep them. New rows always name it.
    op.add_column("jobs", sa.Column("wants_safetensors", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    op.drop_column("jobs", "wants_safetensors")
