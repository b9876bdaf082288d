"""Accepting a job: admission, payload to the object store, row to the database, message to the model's queue.

Admission comes first (:mod:`nnqueue.scheduler.admission`: a live worker serves the model, the key has room),
so a refused job leaves nothing behind. The order of the rest makes an accepted job durable before anyone can run it: the payload is stored first (its
key is derived from a fresh job id), then the QUEUED row is committed, then the task is sent. If the
broker refuses the message the job is marked FAILED with that cause rather than left queued forever.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.db.lifecycle import create_job, transition
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler.admission import AdmissionPolicy, admit
from nnqueue.scheduler.enqueue import enqueue
from nnqueue.storage.keys import payload_key
from nnqueue.storage.object_store import ObjectStore


def submit_job(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    app: Celery,
    *,
    admission: AdmissionPolicy,
    owner: str,
    model_key: str,
    payload: bytes,
    kind: JobKind = JobKind.TRACE,
    timeout_s: float = 600.0,
    priority: int = 0,
    meta: dict[str, Any] | None = None,
    api_key_id: int | None = None,
) -> Job:
    """Accept the job, or raise :class:`~nnqueue.scheduler.admission.AdmissionRefused` (nothing stored)."""
    with sessions() as session:
        admit(session, admission, model_key, api_key_id)
    job_id = uuid.uuid4()
    key = payload_key(job_id)
    size = store.put_bytes(key, payload)
    metrics.STORE_BYTES_WRITTEN.labels("payload").inc(size)
    with transaction(sessions) as session:
        job = create_job(
            session,
            Job(
                id=job_id,
                owner=owner,
                api_key_id=api_key_id,
                model_key=model_key,
                kind=kind,
                timeout_s=timeout_s,
                priority=priority,
                meta=meta or {},
                payload_key=key,
                payload_size=size,
            ),
            detail={"payload_bytes": size},
        )
    metrics.JOBS_SUBMITTED.labels(model_key, kind.value).inc()
    try:
        enqueue(app, job)
    except Exception as error:
        with transaction(sessions) as session:
            transition(
                session,
                job_id,
                JobStatus.FAILED,
                detail={"reason": "enqueue failed"},
                error_type=type(error).__name__,
                error_message=f"the job could not be put on the queue: {error}",
            )
        metrics.JOBS_FINISHED.labels(model_key, kind.value, JobStatus.FAILED.value).inc()
        raise
    return job
