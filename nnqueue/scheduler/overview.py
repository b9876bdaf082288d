"""The load on each model, read from the database: what the metrics endpoint and the status page show.

A model appears when it has a live worker, or a queued or running job or harvest chunk (a model whose workers
all died still has a queue worth seeing). Three queries, each one aggregate, whatever the number of jobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from nnqueue.db.models import HarvestChunk, Job, JobStatus
from nnqueue.scheduler.registry import live_workers


@dataclass
class ModelLoad:
    model_key: str
    queued: int = 0
    running: int = 0
    oldest_queued_at: datetime | None = None
    workers: int = 0
    capacity: int = 0
    chunks_queued: int = 0
    chunks_running: int = 0

    def oldest_queued_age_s(self, now: datetime) -> float:
        return 0.0 if self.oldest_queued_at is None else max(0.0, (now - self.oldest_queued_at).total_seconds())


def model_loads(session: Session, stale_after_s: float, always: Iterable[str] = ()) -> list[ModelLoad]:
    """Every model with live workers or jobs in flight, and every model in ``always`` (idle ones all zero), sorted
    by key."""
    loads: dict[str, ModelLoad] = {key: ModelLoad(key) for key in always}
    in_flight = session.execute(
        select(Job.model_key, Job.status, func.count(), func.min(Job.queued_at))
        .where(Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)))
        .group_by(Job.model_key, Job.status)
    )
    for model_key, status, count, oldest in in_flight:
        load = loads.setdefault(model_key, ModelLoad(model_key))
        if status is JobStatus.QUEUED:
            load.queued, load.oldest_queued_at = count, oldest
        else:
            load.running = count
    chunks = session.execute(
        select(HarvestChunk.model_key, HarvestChunk.status, func.count())
        .where(HarvestChunk.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)))
        .group_by(HarvestChunk.model_key, HarvestChunk.status)
    )
    for model_key, status, count in chunks:
        load = loads.setdefault(model_key, ModelLoad(model_key))
        if status is JobStatus.QUEUED:
            load.chunks_queued = count
        else:
            load.chunks_running = count
    for worker in live_workers(session, stale_after_s):
        load = loads.setdefault(worker.model_key, ModelLoad(worker.model_key))
        load.workers += 1
        load.capacity += worker.capacity
    return [loads[key] for key in sorted(loads)]
