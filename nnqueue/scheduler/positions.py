"""Where queued jobs stand: a job's 1-based place among its model's queued jobs.

Workers claim a model's jobs highest priority first, then oldest first (:data:`nnqueue.scheduler.claim.JOB_ORDER`),
so the place is one plus the number of the model's QUEUED jobs before it in that order: a count over the
``ix_jobs_queued_order`` index, which costs the entries before the job rather than a sort of every queued one.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session, aliased

from nnqueue.db.models import Job, JobStatus


def queue_positions(session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, int]:
    """The place of each QUEUED job in ``jobs`` (jobs in other statuses are left out), in one query."""
    queued = [job.id for job in jobs if job.status is JobStatus.QUEUED]
    if not queued:
        return {}
    ahead = aliased(Job)
    same_priority_before = and_(
        ahead.priority == Job.priority,
        or_(ahead.queued_at < Job.queued_at, and_(ahead.queued_at == Job.queued_at, ahead.id <= Job.id)),
    )
    place = (
        select(func.count())
        .where(
            ahead.model_key == Job.model_key,
            ahead.status == JobStatus.QUEUED,
            or_(ahead.priority > Job.priority, same_priority_before),
        )
        .correlate(Job)
        .scalar_subquery()
    )
    rows = session.execute(select(Job.id, place).where(Job.id.in_(queued), Job.status == JobStatus.QUEUED))
    return {job_id: count for job_id, count in rows}
