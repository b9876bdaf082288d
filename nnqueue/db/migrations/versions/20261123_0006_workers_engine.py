"""workers engine

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Workers registered before this revision all held a vLLM engine.
    op.add_column("workers", sa.Column("engine", sa.String(length=32), nullable=False, server_default="vllm"))


def downgrade() -> None:
    op.drop_column("workers", "engine")
