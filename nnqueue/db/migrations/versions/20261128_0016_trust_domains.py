"""trust domains: a job's domain, the owners grouped into named domains, the domain a worker serves

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A job's trust domain (nnqueue.scheduler.trust_domains); jobs accepted before are each in their owner's own
    # domain, the shipped default.
    op.add_column("jobs", sa.Column("domain", sa.String(220), nullable=True))
    op.execute("UPDATE jobs SET domain = 'owner:' || owner")
    op.create_table(
        "domain_members",
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("domain", sa.String(220), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_domain_members")),
    )
    op.create_index(op.f("ix_domain_members_domain"), "domain_members", ["domain"])
    # The domain whose traces a worker's engine runs now (nnqueue.scheduler.domain_turns), and since when.
    op.add_column("workers", sa.Column("domain", sa.String(220), nullable=True))
    op.add_column("workers", sa.Column("domain_since", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "domain_since")
    op.drop_column("workers", "domain")
    op.drop_index(op.f("ix_domain_members_domain"), table_name="domain_members")
    op.drop_table("domain_members")
    op.drop_column("jobs", "domain")
