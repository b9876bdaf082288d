"""Jobs orphaned by a dead worker go back on their queue without waiting for the broker.

A worker that dies mid-job (SIGKILL, the OOM killer, a lost node) leaves its job RUNNING and the token
it was running unacknowledged. Redis hands that token to another worker only after the visibility
timeout, and a token names no job anyway (see :mod:`nnqueue.broker`): the job must be QUEUED again for
any token to claim it. Live workers do that on each heartbeat: they put their model's RUNNING jobs whose
worker stopped or went silent back to QUEUED and send a fresh token for each (harvest chunks likewise,
:func:`nnqueue.scheduler.chunks.requeue_orphan_chunks`). Duplicate tokens (the dead worker's redelivered
one, say) find no work, or other work, and are harmless; a token whose send failed is re-sent by the
reconciler.
"""

from __future__ import annotations

import logging
import uuid

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import InvalidTransition, JobNotFound, transition
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler.enqueue import send_job_tokens
from nnqueue.scheduler.registry import orphaned

log = logging.getLogger(__name__)


def requeue_orphans(
    sessions: sessionmaker[Session], app: Celery, model_key: str, stale_after_s: float
) -> list[uuid.UUID]:
    """Requeue ``model_key``'s RUNNING jobs whose worker is not live; returns the jobs put back."""
    with sessions() as session:
        orphans = orphaned(session, Job, model_key, stale_after_s)
    requeued = []
    for job_id, dead_worker in orphans:
        if _requeue(sessions, job_id, dead_worker) is not None:
            requeued.append(job_id)
    try:
        send_job_tokens(app, model_key, len(requeued))
    except Exception:  # the reconciler sends them at a later heartbeat
        log.exception("requeued jobs %s, but could not send their tokens; the reconciler will", requeued)
    return requeued


def requeue_held(
    sessions: sessionmaker[Session], app: Celery, model_key: str, worker_id: str, job_ids: list[uuid.UUID], reason: str
) -> list[uuid.UUID]:
    """Put the ``job_ids`` that ``worker_id`` still holds back to QUEUED, a token each (the worker is stopping:
    :mod:`nnqueue.workers.drain`); returns the jobs put back."""
    requeued = []
    for job_id in job_ids:
        try:
            with transaction(sessions) as session:
                transition(
                    session,
                    job_id,
                    JobStatus.QUEUED,
                    detail={"reason": f"worker {worker_id} stopped: {reason}"},
                    held_by=worker_id,
                )
        except (InvalidTransition, JobNotFound):
            continue  # it ended, was cancelled or was taken over meanwhile
        requeued.append(job_id)
    try:
        send_job_tokens(app, model_key, len(requeued))
    except Exception:  # the reconciler sends them at a later heartbeat
        log.exception("requeued jobs %s, but could not send their tokens; the reconciler will", requeued)
    return requeued


def requeue_lost(session: Session, job_id: uuid.UUID, dead_worker: str) -> Job:
    """Put a job RUNNING under ``dead_worker`` back to QUEUED, recording why. The caller commits.

    Raises :class:`InvalidTransition` if it is no longer RUNNING under that worker.
    """
    return transition(
        session, job_id, JobStatus.QUEUED, detail={"reason": f"worker {dead_worker} lost"}, held_by=dead_worker
    )


def _requeue(sessions: sessionmaker[Session], job_id: uuid.UUID, dead_worker: str) -> Job | None:
    """QUEUED again, unless meanwhile another worker requeued or claimed it (or it ended, or was cancelled)."""
    try:
        with transaction(sessions) as session:
            return requeue_lost(session, job_id, dead_worker)
    except (InvalidTransition, JobNotFound):
        return None
