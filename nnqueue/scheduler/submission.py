"""Accepting a job: admission, payload stored, row to the database, a token to the model's queue.

Admission comes first (:mod:`nnqueue.scheduler.admission`: a live worker serves the model, the key has room),
so a refused job leaves nothing behind. The order of the rest makes an accepted job durable before anyone can
run it: the payload is stored first (a small one in the job's own transaction, a large one in the object store
under a key derived from a fresh job id; see :mod:`nnqueue.scheduler.payloads`), then the QUEUED row is
committed, then the token is sent (:mod:`nnqueue.broker`: it names the model, not the job; a worker claims the
model's best queued job). If the broker refuses the token the job is marked FAILED with that cause
rather than left queued forever. The API accepts a job in the transaction of its request (:func:`accept_job`,
then :func:`queue_job`): admission, row and queue position on one connection.
"""

from __future__ import annotations

import uuid
from typing import Any, Required, TypedDict, Unpack

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.db.lifecycle import create_job, transition
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler.admission import AdmissionPolicy, admit
from nnqueue.scheduler.enqueue import send_job_tokens
from nnqueue.scheduler.payloads import keep_inline, store_payload
from nnqueue.storage.object_store import ObjectStore


class JobFields(TypedDict, total=False):
    """What a submitter says about a new job (the keyword arguments of :func:`submit_job` and :func:`accept_job`)."""

    owner: Required[str]
    model_key: Required[str]
    payload: Required[bytes]
    kind: JobKind  # default: a trace
    timeout_s: float  # default: 600
    priority: int
    meta: dict[str, Any]
    api_key_id: int | None  # the submitting API key, which admission limits; None: not counted
    job_id: uuid.UUID | None  # the new job's id when the submitter derives it (it must not exist yet); default: uuid4


def submit_job(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    app: Celery,
    *,
    admission: AdmissionPolicy,
    inline_payload_max_bytes: int = 0,
    **fields: Unpack[JobFields],
) -> Job:
    """Accept the job in a transaction of its own and queue it, or raise
    :class:`~nnqueue.scheduler.admission.AdmissionRefused` (nothing stored)."""
    with transaction(sessions) as session:
        job = accept_job(
            session, store, admission=admission, inline_payload_max_bytes=inline_payload_max_bytes, **fields
        )
    queue_job(sessions, app, job)
    return job


def accept_job(
    session: Session,
    store: ObjectStore,
    *,
    admission: AdmissionPolicy,
    inline_payload_max_bytes: int = 0,
    **fields: Unpack[JobFields],
) -> Job:
    """Admit the job, then add it QUEUED with its payload to the caller's transaction (a large payload goes to the
    object store first). The caller commits, then calls :func:`queue_job`."""
    model_key, payload, api_key_id = fields["model_key"], fields["payload"], fields.get("api_key_id")
    admit(session, admission, model_key, api_key_id)
    job_id = fields.get("job_id") or uuid.uuid4()
    key = store_payload(store, job_id, payload, inline_payload_max_bytes)
    if key is not None:
        metrics.STORE_BYTES_WRITTEN.labels("payload").inc(len(payload))
    job = create_job(
        session,
        Job(
            id=job_id,
            owner=fields["owner"],
            api_key_id=api_key_id,
            model_key=model_key,
            kind=fields.get("kind", JobKind.TRACE),
            timeout_s=fields.get("timeout_s", 600.0),
            priority=fields.get("priority", 0),
            meta=fields.get("meta", {}),
            payload_key=key,
            payload_size=len(payload),
        ),
        detail={"payload_bytes": len(payload)},
    )
    if key is None:
        keep_inline(session, job_id, payload)
    return job


def queue_job(sessions: sessionmaker[Session], app: Celery, job: Job) -> None:
    """Send a committed job's token; if the broker refuses it, mark the job FAILED and re-raise."""
    metrics.JOBS_SUBMITTED.labels(job.model_key, job.kind.value).inc()
    try:
        send_job_tokens(app, job.model_key)
    except Exception as error:
        with transaction(sessions) as session:
            transition(
                session,
                job.id,
                JobStatus.FAILED,
                detail={"reason": "enqueue failed"},
                error_type=type(error).__name__,
                error_message=f"the job could not be put on the queue: {error}",
            )
        metrics.JOBS_FINISHED.labels(job.model_key, job.kind.value, JobStatus.FAILED.value).inc()
        raise
