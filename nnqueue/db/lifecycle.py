"""The one place where a job's status changes.

Every change is a compare-and-set in the database (``UPDATE ... WHERE status IN (allowed sources)``),
so two processes racing on the same job (a redelivered task and a cancel, say) cannot both win:
the loser gets :class:`InvalidTransition` and the row is left as the winner wrote it. Each change
appends a :class:`~nnqueue.db.models.JobEvent` in the same transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from nnqueue.db.models import Job, JobEvent, JobStatus, utcnow
from nnqueue.db.session import updated
from nnqueue.errors import NNqueueError

S = JobStatus
# Which statuses each status may be entered from. RUNNING -> QUEUED is a redelivery after a worker was lost.
ALLOWED_FROM: dict[JobStatus, frozenset[JobStatus]] = {
    S.QUEUED: frozenset({S.RUNNING}),
    S.RUNNING: frozenset({S.QUEUED}),
    S.COMPLETED: frozenset({S.RUNNING}),
    S.FAILED: frozenset({S.QUEUED, S.RUNNING}),
    S.CANCELLED: frozenset({S.QUEUED, S.RUNNING}),
}


class JobNotFound(NNqueueError, LookupError):
    pass


class InvalidTransition(NNqueueError, ValueError):
    def __init__(self, job_id: uuid.UUID, current: JobStatus, target: JobStatus, reason: str = "") -> None:
        super().__init__(f"job {job_id} is {current.value}{reason}; it cannot become {target.value}")
        self.job_id, self.current, self.target = job_id, current, target


def _timestamps(target: JobStatus) -> dict[str, Any]:
    now = utcnow()
    if target is S.QUEUED:
        return {"queued_at": now}
    if target is S.RUNNING:
        return {"started_at": now, "attempts": Job.attempts + 1}
    return {"finished_at": now}


def create_job(session: Session, job: Job, detail: dict[str, Any] | None = None) -> Job:
    """Add a new job in QUEUED, with its first event. The caller commits."""
    job.status = S.QUEUED
    job.queued_at = utcnow()
    session.add(job)
    session.flush()
    session.add(JobEvent(job_id=job.id, from_status=None, to_status=S.QUEUED, detail=detail or {}))
    return job


def transition(
    session: Session,
    job_id: uuid.UUID,
    target: JobStatus,
    *,
    detail: dict[str, Any] | None = None,
    held_by: str | None = None,
    **fields: Any,
) -> Job:
    """Move ``job_id`` to ``target`` and set ``fields`` on it, or raise. The caller commits.

    ``held_by``: change it only while that worker holds it (a worker finishing its job, which may
    meanwhile have been requeued and claimed by another because this one looked dead).
    Raises :class:`JobNotFound` or :class:`InvalidTransition` (the job is then unchanged).
    """
    # FOR UPDATE holds the row on Postgres until commit; SQLite ignores it, and there the
    # guards of the UPDATE (status, and holder) are what make the change a compare-and-set.
    row = session.execute(select(Job.status, Job.worker_id).where(Job.id == job_id).with_for_update()).first()
    if row is None:
        raise JobNotFound(f"no job {job_id}")
    current, holder = row
    if current not in ALLOWED_FROM[target]:
        raise InvalidTransition(job_id, current, target)
    if held_by is not None and holder != held_by:
        raise InvalidTransition(job_id, current, target, f" under worker {holder}, not {held_by}")
    guards = [Job.id == job_id, Job.status == current]
    if held_by is not None:
        guards.append(Job.worker_id == held_by)
    if updated(session, update(Job).where(*guards).values(status=target, **_timestamps(target), **fields)) != 1:
        now = session.scalar(select(Job.status).where(Job.id == job_id))
        raise InvalidTransition(job_id, now or current, target)
    session.add(JobEvent(job_id=job_id, from_status=current, to_status=target, detail=detail or {}))
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    return job
