"""Where queued jobs stand: a job's 1-based place among its model's queued jobs.

Workers claim a model's jobs highest priority first, then oldest first (:data:`nnqueue.scheduler.claim.JOB_ORDER`),
so the place is one plus the number of the model's QUEUED jobs before it in that order: a count over the
``ix_jobs_queued_order`` index, which costs the entries before the job rather than a sort of every queued one.
The statement is built once: building it (an aliased table, a correlated subquery) cost more CPU than running it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import and_, bindparam, func, or_, select
from sqlalchemy.orm import Session, aliased

from nnqueue.db.models import Job, JobStatus

_ahead = aliased(Job)
_place = (
    select(func.count())
    .where(
        _ahead.model_key == Job.model_key,
        _ahead.status == JobStatus.QUEUED,
        or_(
            _ahead.priority > Job.priority,
            and_(
                _ahead.priority == Job.priority,
                or_(_ahead.queued_at < Job.queued_at, and_(_ahead.queued_at == Job.queued_at, _ahead.id <= Job.id)),
            ),
        ),
    )
    .correlate(Job)
    .scalar_subquery()
)
_POSITIONS = select(Job.id, _place).where(Job.id.in_(bindparam("ids", expanding=True)), Job.status == JobStatus.QUEUED)


def queue_positions(session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, int]:
    """The place of each QUEUED job in ``jobs`` (jobs in other statuses are left out), in one query."""
    queued = [job.id for job in jobs if job.status is JobStatus.QUEUED]
    if not queued:
        return {}
    return {job_id: count for job_id, count in session.execute(_POSITIONS, {"ids": queued})}
