"""Queued work written straight into the database, as submissions leave it (without tokens on the broker): jobs
and harvests whose chunks wait to be claimed."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import create_job
from nnqueue.db.models import Harvest, HarvestChunk, Job, JobKind, JobStatus, utcnow
from nnqueue.db.session import transaction
from nnqueue.scheduler.claim import claim_jobs


def queue_job(
    sessions: sessionmaker[Session],
    model_key: str,
    priority: int = 0,
    *,
    owner: str = "alice",
    kind: JobKind = JobKind.TRACE,
    domain: str | None = None,
) -> uuid.UUID:
    """A QUEUED job (a trace of alice's unless told) for ``model_key``; ``domain`` None: its owner's own."""
    with transaction(sessions) as session:
        job = Job(
            owner=owner,
            domain=domain,
            model_key=model_key,
            kind=kind,
            priority=priority,
            timeout_s=60,
            meta={},
            payload_key="p",
            payload_size=1,
        )
        return create_job(session, job).id


def claim_next_job(sessions: sessionmaker[Session], model_key: str, worker_id: str) -> Job | None:
    """What one token of a worker claims: the best QUEUED job of ``model_key``, or None."""
    claimed = claim_jobs(sessions, model_key, worker_id, 1)
    return claimed[0] if claimed else None


def add_harvest(
    sessions: sessionmaker[Session], model_key: str, owner: str, chunks: int, priority: int = 0
) -> list[int]:
    """A harvest of ``owner`` with ``chunks`` QUEUED chunks of one prompt each, queued one millisecond apart."""
    with transaction(sessions) as session:
        harvest = Harvest(
            owner=owner,
            model_key=model_key,
            status=JobStatus.QUEUED,
            priority=priority,
            spec={},
            dataset_key="d",
            dataset_digest="0" * 64,
            prompts=chunks,
            chunks_total=chunks,
        )
        session.add(harvest)
        session.flush()
        rows = [
            HarvestChunk(
                harvest_id=harvest.id,
                index=index,
                model_key=model_key,
                owner=owner,
                priority=priority,
                status=JobStatus.QUEUED,
                first_prompt=index,
                prompts=1,
                dataset_start=index,
                dataset_end=index + 1,
                shard_key=f"harvests/{harvest.id}/shard-{index:05d}.safetensors",
                queued_at=utcnow() + timedelta(milliseconds=index),
            )
            for index in range(chunks)
        ]
        session.add_all(rows)
        session.flush()
        return [row.id for row in rows]
