"""``/v1/steering``: submit a declarative steering job, follow it, cancel it, read its generations (and the
activations its captures recorded).

A steering job runs no user code (`nnqueue.scheduler.steering`), so submitting needs the ``harvest`` scope (a
default key's), not ``trace``; the other routes ``harvest`` or ``admin``. Like jobs, every route sees only the
caller's own steering jobs (another owner's answer 404) unless the key has the ``admin`` scope. A submission is
a multipart form: ``spec`` (the JSON :class:`~nnqueue.scheduler.steering.SteerSpec`), optionally ``vectors`` (a
safetensors file of 1-D float tensors the edits name) and ``dataset`` (a JSONL, Parquet or text file of
prompts). Every refusal is a 4xx with its reason: 422 (bad spec, an unknown module with the steerable ones, a
vector of the wrong size, a missing vector), 400 (no live worker), 404/409/410 (a harvest named for a vector is
not yours, not completed, or its manifest is gone), 413 (too large), 429 (the key's jobs in flight).
The job itself is a job of kind ``steer``: its row, queue, cancel and retention are a trace's.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, HTTPException, Query, UploadFile, status
from fastapi.responses import RedirectResponse, StreamingResponse
from sqlalchemy import select

from nnqueue.api.deps import HarvestCallerDep, HarvestReaderDep, ResourcesDep, SessionDep, SessionsDep
from nnqueue.api.ownership import owned_or_404
from nnqueue.api.pagination import IdPrefixQuery
from nnqueue.api.refusals import refusals_as_http
from nnqueue.api.routers.jobs import cancel_response, result_response
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import JobListResponse, JobResponse, parse_spec_field
from nnqueue.db.ids import starting_with
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.scheduler.harvest_dataset import Limits
from nnqueue.scheduler.harvest_spec import HarvestRejected
from nnqueue.scheduler.positions import queue_positions
from nnqueue.scheduler.steering import SteerSpec, SteerSubmission, accept_steering
from nnqueue.scheduler.submission import queue_job

router = APIRouter(prefix="/v1/steering", tags=["steering"], route_class=ReleasingRoute)
NOT_YOURS: dict[int | str, dict[str, Any]] = {404: {"description": "No such steering job, or another owner's."}}
SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "No live worker serves the model, or its workers run no steering."},
    404: {"description": "A harvest named for a vector is not the caller's, or the dataset's file is missing."},
    409: {"description": "A harvest named for a vector has not completed."},
    413: {"description": "The vectors file, the dataset or its prompts are over their limits."},
    422: {"description": "The spec is invalid: unknown module, wrong vector size, missing vector, ..."},
    429: {"description": "The key has its limit of jobs queued or running."},
}


@router.post("", status_code=status.HTTP_201_CREATED, responses=SUBMIT_ERRORS)
def submit(
    caller: HarvestCallerDep,
    resources: ResourcesDep,
    session: SessionDep,
    spec: Annotated[str, Form(description="The steering spec, a JSON object (see docs/user/steering.md).")],
    vectors: Annotated[UploadFile | None, File(description="A safetensors file of 1-D float vectors.")] = None,
    dataset: Annotated[UploadFile | None, File(description="A JSONL, Parquet or text file of prompts.")] = None,
) -> JobResponse:
    """Check the spec against the model's published capture points, freeze prompts and vectors, queue the job."""
    steer_spec = parse_spec_field(spec, SteerSpec)
    settings = resources.settings
    submission = SteerSubmission(
        owner=caller.owner,
        limits=Limits(settings.harvest_max_dataset_bytes, settings.steer_max_prompts),
        stale_after_s=settings.worker_stale_after_s,
        max_vector_bytes=settings.steer_max_vector_bytes,
        admission=resources.admission,
        default_timeout_s=settings.default_job_timeout_s,
        inline_payload_max_bytes=settings.inline_payload_max_bytes,
        api_key_id=caller.key_id,
        vectors=None if vectors is None else vectors.file.read(settings.steer_max_vector_bytes + 1),
        dataset=None
        if dataset is None
        else (dataset.filename or "dataset", dataset.file.read(settings.harvest_max_dataset_bytes + 1)),
    )
    try:
        with refusals_as_http():
            accepted = accept_steering(session, resources.store, steer_spec, submission)
    except HarvestRejected as rejected:
        raise HTTPException(rejected.status, rejected.reason) from None
    session.commit()
    queue_job(resources.sessions, resources.celery, accepted.job)
    return JobResponse.of(accepted.job, accepted.queue_position)


@router.get("")
def list_steering(
    caller: HarvestReaderDep,
    session: SessionDep,
    status_filter: Annotated[JobStatus | None, Query(alias="status")] = None,
    owner: Annotated[
        str | None, Query(description="Only this owner's (admins; others may name only themselves).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    id_prefix: IdPrefixQuery = None,
) -> JobListResponse:
    """The caller's steering jobs (an admin's: every owner's), newest first."""
    query = select(Job).where(Job.kind == JobKind.STEER)
    if (listed := caller.listed_owner(owner)) is not None:
        query = query.where(Job.owner == listed)
    if id_prefix is not None:
        query = query.where(starting_with(Job.id, id_prefix))
    if status_filter is not None:
        query = query.where(Job.status == status_filter)
    jobs = list(session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)))
    positions = queue_positions(session, jobs)
    return JobListResponse(jobs=[JobResponse.of(job, positions.get(job.id)) for job in jobs], next_cursor=None)


@router.get("/{job_id}", responses=NOT_YOURS)
def get_steering(job_id: uuid.UUID, caller: HarvestReaderDep, session: SessionDep) -> JobResponse:
    job = _steering(session, job_id, caller)
    return JobResponse.of(job, queue_positions(session, [job]).get(job.id))


@router.post("/{job_id}/cancel", responses={**NOT_YOURS, 409: {"description": "The job has already ended."}})
def cancel(job_id: uuid.UUID, caller: HarvestReaderDep, session: SessionDep, sessions: SessionsDep) -> JobResponse:
    """Cancel a queued or running steering job (a running one's requests are aborted within a heartbeat)."""
    _steering(session, job_id, caller)
    return cancel_response(sessions, job_id, caller.owner, "steering job")


@router.get(
    "/{job_id}/result",
    response_model=None,
    response_class=StreamingResponse,
    responses={
        **NOT_YOURS,
        200: {
            "content": {"application/json": {}, "application/octet-stream": {}},
            "description": "The generations, or the activations (inline).",
        },
        302: {"description": "Redirect to a presigned object-store URL."},
        409: {"description": "The job has not completed, or recorded no activations (its spec had no captures)."},
        410: {"description": "The result was deleted (NNQUEUE_RETENTION_DAYS)."},
    },
)
def download_result(
    job_id: uuid.UUID,
    caller: HarvestReaderDep,
    session: SessionDep,
    resources: ResourcesDep,
    inline: bool = False,
    file: Annotated[
        Literal["generations", "activations"],
        Query(description="generations (JSON), or activations (safetensors: the spec's captures)."),
    ] = "generations",
) -> StreamingResponse | RedirectResponse:
    """The generations, JSON (``{"format", "generations": [{"token_ids", "text", "finish_reason", "logprobs",
    "top_logprobs"}]}``, one per prompt in order), or with ``file=activations`` the captures recorded while
    steering (a harvest shard's safetensors: ``prompt_index``, ``token_position``, ``token_id`` and a tensor per
    capture): a presigned redirect, or the bytes when ``inline``."""
    job = _steering(session, job_id, caller)
    fmt = "safetensors" if file == "activations" else "torch"  # the job routes' names for the two files
    return result_response(job, fmt, resources.store, resources.settings, inline=inline)


def _steering(session: Any, job_id: uuid.UUID, caller: Any) -> Job:
    job = owned_or_404(session, Job, job_id, caller)
    if job.kind is not JobKind.STEER:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no steering job {job_id}")
    return job
