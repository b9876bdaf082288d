"""The one place where a job's status changes.

Every change is a compare-and-set in the database (``UPDATE ... WHERE status IN (allowed sources)``),
so two processes racing on the same job (a redelivered task and a cancel, say) cannot both win:
the loser gets :class:`InvalidTransition` and the row is left as the winner wrote it. Each change
appends a :class:`~nnqueue.db.models.JobEvent` in the same transaction. A worker claims and finishes its
jobs many at a time (:func:`start_queued`, :func:`finish_held`): the same compare-and-set for each row, a
few statements for all of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, select, update
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


def start_queued(session: Session, job_ids: Sequence[uuid.UUID], worker_id: str) -> list[uuid.UUID]:
    """Move those of ``job_ids`` that are still QUEUED to RUNNING under ``worker_id``, in one UPDATE whose
    guard is each row's status, and return them (the others were meanwhile claimed or cancelled). The caller
    commits."""
    if not job_ids:
        return []
    started = session.scalars(
        update(Job)
        .where(Job.id.in_(job_ids), Job.status == S.QUEUED)
        .values(status=S.RUNNING, worker_id=worker_id, **_timestamps(S.RUNNING))
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    ).all()
    _add_events(session, [(job_id, S.QUEUED, S.RUNNING, {"worker": worker_id}) for job_id in started])
    return list(started)


@dataclass(frozen=True)
class Ending:
    """How a worker's job ended: its final status and the fields to set with it."""

    job_id: uuid.UUID
    target: JobStatus  # COMPLETED or FAILED
    detail: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)


def finish_held(session: Session, endings: Sequence[Ending], worker_id: str) -> list[Job | NNqueueError]:
    """End each job that is RUNNING under ``worker_id`` as its :class:`Ending` says (a compare-and-set on status
    and holder per row), and return, in order, the ended :class:`Job` or, for a job that is not (any more)
    RUNNING under this worker, left unchanged, the :class:`InvalidTransition` (or :class:`JobNotFound`) that
    says why. The caller commits."""
    results: dict[uuid.UUID, Job | NNqueueError] = {}
    # Rows are locked in id order, as the progress writer's statement locks them: two transactions that each
    # hold some of the same jobs never wait for each other in a circle (a deadlock Postgres would break by
    # failing one).
    for ending in sorted(endings, key=lambda ending: ending.job_id):
        if ending.target not in (S.COMPLETED, S.FAILED):
            raise ValueError(f"a held job ends COMPLETED or FAILED, not {ending.target.value}")
        ended = session.scalar(
            update(Job)
            .where(Job.id == ending.job_id, Job.status == S.RUNNING, Job.worker_id == worker_id)
            .values(status=ending.target, **_timestamps(ending.target), **ending.fields)
            .returning(Job)
            .execution_options(synchronize_session=False, populate_existing=True)
        )
        results[ending.job_id] = ended if ended is not None else _not_held(session, ending, worker_id)
    _add_events(
        session,
        [
            (ending.job_id, S.RUNNING, ending.target, ending.detail)
            for ending in endings
            if isinstance(results[ending.job_id], Job)
        ],
    )
    return [results[ending.job_id] for ending in endings]


def _not_held(session: Session, ending: Ending, worker_id: str) -> NNqueueError:
    row = session.execute(select(Job.status, Job.worker_id).where(Job.id == ending.job_id)).first()
    if row is None:
        return JobNotFound(f"no job {ending.job_id}")
    current, holder = row
    reason = "" if current is not S.RUNNING else f" under worker {holder}, not {worker_id}"
    return InvalidTransition(ending.job_id, current, ending.target, reason)


def _add_events(session: Session, changes: Sequence[tuple[uuid.UUID, JobStatus, JobStatus, dict[str, Any]]]) -> None:
    """Append one event per (job, from, to, detail) change, in one statement."""
    if changes:
        rows = [
            {"job_id": job_id, "from_status": old, "to_status": new, "detail": detail}
            for job_id, old, new, detail in changes
        ]
        session.execute(insert(JobEvent), rows)
