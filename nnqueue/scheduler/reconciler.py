"""The reconciler: re-sends the tokens that the broker lost, so nothing accepted waits forever.

The database is the record of what waits (QUEUED jobs and harvest chunks); the broker only holds tokens
that wake workers up. If Redis restarts empty (no persistence) or a send failed, QUEUED work has no token
and no worker would ever claim it. Each worker's heartbeat (throttled to ``NNQUEUE_RECONCILE_INTERVAL_S``)
counts, for its model and each of its two queues, the units QUEUED for longer than a short grace and the
tokens waiting on the queue, and sends the difference. Tokens that workers hold while running are not
counted, nor needed: they belong to RUNNING work. A token too many is harmless (it finds no work, or
other work, and is dropped), so racing with a submission or with another worker's reconciler only costs
a message.

Units pinned to a weights version that no live worker of the model serves (:mod:`nnqueue.scheduler.weights`) are
not counted: no worker could claim them, so their tokens would be taken and dropped at every interval. They wait
without one, and the reconciler of a worker that serves their version (one that comes back) sends it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from celery import Celery
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.broker import bulk_queue_name, queue_name, ready_messages
from nnqueue.db.models import HarvestChunk, Job, JobStatus, utcnow
from nnqueue.scheduler.enqueue import send_chunk_tokens, send_job_tokens
from nnqueue.scheduler.weights import served_versions

log = logging.getLogger(__name__)
# Units queued this recently are left alone: their own token may be on its way.
GRACE_S = 2.0


@dataclass(frozen=True)
class Resent:
    jobs: int
    chunks: int


def reconcile(sessions: sessionmaker[Session], app: Celery, model_key: str, stale_after_s: float) -> Resent:
    """Send ``model_key``'s missing tokens, on both queues; returns how many were sent. ``stale_after_s``: how
    recent a worker's heartbeat must be for the versions it serves to count."""
    cutoff = utcnow() - timedelta(seconds=GRACE_S)
    with sessions() as session:
        served = list(served_versions(session, model_key, stale_after_s))
        jobs = session.scalar(
            select(func.count())
            .select_from(Job)
            .where(
                Job.model_key == model_key,
                Job.status == JobStatus.QUEUED,
                Job.queued_at <= cutoff,
                or_(Job.weights_pin.is_(None), Job.weights_pin.in_(served)),
            )
        )
        chunks = session.scalar(
            select(func.count())
            .select_from(HarvestChunk)
            .where(
                HarvestChunk.model_key == model_key,
                HarvestChunk.status == JobStatus.QUEUED,
                HarvestChunk.queued_at <= cutoff,
                or_(HarvestChunk.weights_pin.is_(None), HarvestChunk.weights_pin.in_(served)),
            )
        )
    missing_jobs = max(0, (jobs or 0) - ready_messages(app, queue_name(model_key)))
    missing_chunks = max(0, (chunks or 0) - ready_messages(app, bulk_queue_name(model_key)))
    send_job_tokens(app, model_key, missing_jobs)
    send_chunk_tokens(app, model_key, missing_chunks)
    if missing_jobs or missing_chunks:
        log.warning(
            "reconciler: the broker lacked tokens for %d queued jobs and %d queued chunks of %s; re-sent them",
            missing_jobs,
            missing_chunks,
            model_key,
        )
    return Resent(missing_jobs, missing_chunks)
