"""Where queued jobs stand: a job's 1-based place among its model's queued jobs.

Workers claim a model's jobs highest priority first, then oldest first (:data:`nnqueue.scheduler.claim.JOB_ORDER`),
so the place is one plus the number of the model's QUEUED jobs before it in that order: a count over the
``ix_jobs_queued_order`` index, which costs the entries before the job rather than a sort of every queued one.
The statement is built once: building it (an aliased table, a correlated subquery) cost more CPU than running it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ScalarSelect, and_, bindparam, func, or_, select
from sqlalchemy.orm import Session, aliased

from nnqueue.db.models import Job, JobStatus


def jobs_ahead(model_key: Any, priority: Any, queued_at: Any, job_id: Any) -> ScalarSelect[int]:
    """How many of ``model_key``'s QUEUED jobs run before (or are) a job with this priority, time and id: its place
    when it is one of them, one less than its place when the count cannot see it (it is being added)."""
    ahead = aliased(Job)
    return (
        select(func.count())
        .where(
            ahead.model_key == model_key,
            ahead.status == JobStatus.QUEUED,
            or_(
                ahead.priority > priority,
                and_(
                    ahead.priority == priority,
                    or_(ahead.queued_at < queued_at, and_(ahead.queued_at == queued_at, ahead.id <= job_id)),
                ),
            ),
        )
        .scalar_subquery()
    )


_place = jobs_ahead(Job.model_key, Job.priority, Job.queued_at, Job.id).correlate(Job)
_POSITIONS = select(Job.id, _place).where(Job.id.in_(bindparam("ids", expanding=True)), Job.status == JobStatus.QUEUED)


def queue_positions(session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, int]:
    """The place of each QUEUED job in ``jobs`` (jobs in other statuses are left out), in one query."""
    queued = [job.id for job in jobs if job.status is JobStatus.QUEUED]
    if not queued:
        return {}
    return {job_id: count for job_id, count in session.execute(_POSITIONS, {"ids": queued})}
