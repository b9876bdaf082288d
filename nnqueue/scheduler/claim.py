"""Claiming a delivered job: the database decides which delivery of a task message runs the job.

A message can arrive twice (a worker died, or Redis's visibility timeout passed); only the delivery
that moves the job to RUNNING runs it. Claims are compare-and-set, so racing deliveries and cancels
cannot both win.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import InvalidTransition, transition
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler import registry
from nnqueue.scheduler.recovery import requeue_lost

log = logging.getLogger(__name__)
S = JobStatus


def claim(sessions: sessionmaker[Session], job_id: uuid.UUID, worker_id: str, stale_after_s: float) -> Job | None:
    """Move the job to RUNNING for this worker, or return None if this delivery must not run it.

    A job RUNNING under a worker whose heartbeat went stale was orphaned by a dead process: it is
    put back to QUEUED (recorded in its history) and claimed again.
    """
    try:
        with transaction(sessions) as session:
            job = session.get(Job, job_id)
            if job is None:
                log.warning("task for unknown job %s dropped", job_id)
                return None
            if job.status is S.RUNNING:
                if job.worker_id == worker_id or registry.is_alive(session, job.worker_id or "", stale_after_s):
                    return None
                requeue_lost(session, job_id, job.worker_id or "")
            elif job.status is not S.QUEUED:
                return None
            return transition(session, job_id, S.RUNNING, detail={"worker": worker_id}, worker_id=worker_id)
    except InvalidTransition:
        return None  # another delivery or a cancel won the race
