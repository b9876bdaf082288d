"""Where queued jobs stand: a job's 1-based place among its model's queued jobs.

Workers claim a model's jobs highest priority first, then oldest first (:data:`nnqueue.scheduler.claim.JOB_ORDER`),
so the place is the job's rank in that same order among the model's QUEUED jobs.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from nnqueue.db.models import Job, JobStatus
from nnqueue.scheduler.claim import JOB_ORDER


def queue_positions(session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, int]:
    """The place of each QUEUED job in ``jobs`` (jobs in other statuses are left out), in one query."""
    queued = [job for job in jobs if job.status is JobStatus.QUEUED]
    if not queued:
        return {}
    place = func.row_number().over(partition_by=Job.model_key, order_by=JOB_ORDER)
    ranked = (
        select(Job.id, place.label("place"))
        .where(Job.status == JobStatus.QUEUED, Job.model_key.in_({job.model_key for job in queued}))
        .subquery()
    )
    rows = session.execute(select(ranked.c.id, ranked.c.place).where(ranked.c.id.in_([job.id for job in queued])))
    return {job_id: place for job_id, place in rows}
