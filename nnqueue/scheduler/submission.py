"""Accepting a job: admission, row and payload to the database (or the payload to the object store), a token to
the model's queue.

Admission comes first (:mod:`nnqueue.scheduler.admission`: a live worker serves the model, the key has room; the
second is checked by the statement that adds the row, :mod:`nnqueue.scheduler.intake`), so a refused job leaves
nothing behind. The order of the rest makes an accepted job durable before anyone can run it: the QUEUED row is
added in a transaction with its payload (a small one beside it, a large one stored in the object store under a
key derived from the job id before the transaction commits; see :mod:`nnqueue.scheduler.payloads`), then the
token is sent (:mod:`nnqueue.broker`: it names the model, not the job; a worker claims the model's best queued
job). If the broker refuses the token the job is marked FAILED with that cause rather than left queued forever.
The API accepts a job in the transaction of its request (:func:`accept_job`, then :func:`queue_job`): admission,
row and queue position in one statement on Postgres.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Required, TypedDict, Unpack

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import EngineKind, Job, JobKind, JobStatus, utcnow
from nnqueue.db.session import transaction
from nnqueue.scheduler.admission import AdmissionPolicy, require_served
from nnqueue.scheduler.enqueue import send_job_tokens
from nnqueue.scheduler.intake import add_job
from nnqueue.scheduler.payloads import object_key, store_payload
from nnqueue.scheduler.trust_domains import default_domain
from nnqueue.scheduler.weights import resolve_pin
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
    engine: (
        EngineKind | None
    )  # the engine kind the job needs (admission refuses a model served by others); default: any
    weights_pin: str | None  # a weights version, or "latest" (nnqueue.scheduler.weights); default: any
    wants_safetensors: bool  # also write the result as safetensors; default: no


@dataclass(frozen=True)
class Accepted:
    """A job added to its submitter's transaction, and its 1-based place among its model's queued jobs."""

    job: Job
    queue_position: int


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
        accepted = accept_job(
            session, store, admission=admission, inline_payload_max_bytes=inline_payload_max_bytes, **fields
        )
    queue_job(sessions, app, accepted.job)
    return accepted.job


def accept_job(
    session: Session,
    store: ObjectStore,
    *,
    admission: AdmissionPolicy,
    inline_payload_max_bytes: int = 0,
    **fields: Unpack[JobFields],
) -> Accepted:
    """Admit the job and add it QUEUED to the caller's transaction, with its payload when that is at most
    ``inline_payload_max_bytes`` (a larger one goes to the object store, after the row and before the caller
    commits); raises :class:`~nnqueue.scheduler.admission.AdmissionRefused`, adding and storing nothing.
    The caller commits, then calls :func:`queue_job`."""
    require_served(session, admission, fields["model_key"], fields.get("engine"))
    key_id = fields.get("api_key_id")
    if (
        admission.crash_cooldowns is not None
        and key_id is not None
        and fields.get("kind", JobKind.TRACE) is JobKind.TRACE
    ):
        admission.crash_cooldowns.check(session, fields["owner"])
    payload = fields["payload"]
    fields["weights_pin"] = resolve_pin(
        session, fields["model_key"], fields.get("weights_pin"), admission.stale_after_s
    )
    job = _new_job(fields, inline_payload_max_bytes, default_domain(fields["owner"], admission.trust_domains))
    inline = payload if job.payload_key is None else None
    position = add_job(
        session, job, inline, admission.max_jobs_in_flight_per_key, admission.max_jobs_in_flight_per_owner
    )
    if job.payload_key is not None:
        store_payload(store, job.payload_key, payload)
    return Accepted(job, position)


def _new_job(fields: JobFields, inline_payload_max_bytes: int, domain: str) -> Job:
    """The QUEUED job that ``fields`` describe, every column set (it is inserted without the ORM's defaults); in
    ``domain`` unless its owner's group replaces it (:func:`nnqueue.scheduler.intake.add_job`)."""
    job_id, now = fields.get("job_id") or uuid.uuid4(), utcnow()
    return Job(
        id=job_id,
        owner=fields["owner"],
        domain=domain,
        api_key_id=fields.get("api_key_id"),
        model_key=fields["model_key"],
        kind=fields.get("kind", JobKind.TRACE),
        status=JobStatus.QUEUED,
        priority=fields.get("priority", 0),
        timeout_s=fields.get("timeout_s", 600.0),
        meta=fields.get("meta", {}),
        payload_key=object_key(job_id, len(fields["payload"]), inline_payload_max_bytes),
        payload_size=len(fields["payload"]),
        attempts=0,
        progress_done=0,
        weights_pin=fields.get("weights_pin"),
        wants_safetensors=fields.get("wants_safetensors", False),
        created_at=now,
        queued_at=now,
    )


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
