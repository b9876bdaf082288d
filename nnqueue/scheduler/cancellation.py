"""Cancelling a job: the database is the signal.

A QUEUED job's token stays in the queue, but claims take only QUEUED jobs: the token finds the model's
other work, or none, and the cancelled job never runs. A RUNNING job is noticed by its worker's heartbeat, which aborts the job's
vLLM requests (see :meth:`nnqueue.workers.job_execution.JobRunner.reap_lost`).
"""

from __future__ import annotations

import uuid

from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import transaction


def cancel_job(sessions: sessionmaker[Session], job_id: uuid.UUID, *, by: str) -> Job:
    """Mark the job CANCELLED; raises ``InvalidTransition`` if it has already ended."""
    with transaction(sessions) as session:
        job = transition(session, job_id, JobStatus.CANCELLED, detail={"by": by})
    metrics.JOBS_FINISHED.labels(job.model_key, job.kind.value, JobStatus.CANCELLED.value).inc()
    return job
