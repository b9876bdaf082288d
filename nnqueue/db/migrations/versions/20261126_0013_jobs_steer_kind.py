"""jobs: the steer kind

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 17:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The job kind is a non-native enum: a VARCHAR(16) with a CHECK constraint listing its values.
BEFORE = ("trace", "harvest")
AFTER = (*BEFORE, "steer")


def _kinds(values: tuple[str, ...]) -> sa.Enum:
    return sa.Enum(*values, name="job_kind", native_enum=False, create_constraint=True, length=16)


def upgrade() -> None:
    # A declarative steering job (nnqueue.scheduler.steering) is a job of kind "steer".
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("kind", existing_type=_kinds(BEFORE), type_=_kinds(AFTER), existing_nullable=False)


def downgrade() -> None:
    op.execute("DELETE FROM jobs WHERE kind = 'steer'")
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("kind", existing_type=_kinds(AFTER), type_=_kinds(BEFORE), existing_nullable=False)
