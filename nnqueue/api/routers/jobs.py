"""``/v1/jobs``: submit, inspect, list, cancel, and download results.

Every route sees only the caller's own jobs: another owner's job answers 404, exactly as a job
that does not exist, so ids cannot be probed. A key with the ``admin`` scope sees, cancels and
downloads every owner's jobs; submitting a trace needs the ``trace`` scope (403 otherwise). Submission checks its limits before anything is
stored: the spec (422), the payload size (413) and its format (422: a prebuilt trace whose header is
valid, or something that starts like an nnsight serialized trace; read, never unpickled) here, then the
admission of ``accept_job``: a live worker for the model (400) and the key's jobs in flight (429; see
:mod:`nnqueue.scheduler.admission`).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import trace_payload
from nnqueue.api.deps import (
    CallerDep,
    ResourcesDep,
    SessionDep,
    SessionsDep,
    SettingsDep,
    StoreDep,
    check_scope,
)
from nnqueue.api.downloads import object_response
from nnqueue.api.job_body import OPENAPI_BODY, Submission, read_submission
from nnqueue.api.ownership import owned_or_404
from nnqueue.api.pagination import NEWEST_FIRST, IdPrefixQuery, InvalidCursor, encode_cursor, older_than
from nnqueue.api.refusals import refusals_as_http
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import JobListResponse, JobResponse, JobSpec, parse_spec_field
from nnqueue.db.ids import starting_with
from nnqueue.db.lifecycle import InvalidTransition
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.scheduler.cancellation import cancel_job
from nnqueue.scheduler.positions import queue_positions
from nnqueue.scheduler.submission import accept_job, queue_job
from nnqueue.scheduler.weights import waiting_reasons
from nnqueue.settings import Settings
from nnqueue.storage.keys import ACTIVATIONS_FILE, SAFETENSORS_FILE, sibling_key
from nnqueue.storage.object_store import ObjectStore

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=ReleasingRoute)
NOT_YOURS: dict[int | str, dict[str, Any]] = {404: {"description": "No such job, or another owner's."}}
SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "No live worker serves the model; the detail names the live models."},
    403: {"description": "The key lacks the scope of the job's kind (`trace`)."},
    413: {"description": "The payload is over NNQUEUE_MAX_PAYLOAD_BYTES."},
    429: {
        "description": "The key has NNQUEUE_MAX_JOBS_IN_FLIGHT_PER_KEY jobs queued or running, or its traces crashed"
        " engines NNQUEUE_ENGINE_CRASH_LIMIT times (a cool-down; Retry-After says how long)."
    },
    503: {"description": "The broker is unreachable; the job was not queued."},
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobResponse,
    responses=SUBMIT_ERRORS,
    openapi_extra=OPENAPI_BODY,
)
def submit(
    caller: CallerDep,
    resources: ResourcesDep,
    session: SessionDep,
    submission: Annotated[Submission, Depends(read_submission)],
) -> Response:
    """Store the payload, create the job and put it on its model's queue.

    The body is the payload (``application/octet-stream``) with the spec in the ``Nnqueue-Spec`` header, or a
    multipart form of the two (``spec``, ``payload``).

    One transaction on one connection; on Postgres one statement: admission, the job's row (and a small payload), its
    queue position (:mod:`nnqueue.scheduler.intake`).
    """
    settings = resources.settings
    job_spec = parse_spec_field(submission.spec, JobSpec, submission.spec_loc)
    check_scope(caller, job_spec.kind)
    data = submission.payload
    _require_trace(data)
    meta: dict[str, Any] = {"metadata": job_spec.metadata}
    if job_spec.client is not None:
        meta["client"] = job_spec.client.model_dump()
    with refusals_as_http():
        accepted = accept_job(
            session,
            resources.store,
            admission=resources.admission,
            owner=caller.owner,
            api_key_id=caller.key_id,
            model_key=job_spec.model_key,
            payload=data,
            kind=JobKind(job_spec.kind),
            timeout_s=settings.default_job_timeout_s if job_spec.timeout_s is None else job_spec.timeout_s,
            priority=job_spec.priority,
            meta=meta,
            weights_pin=job_spec.weights_version,
            wants_safetensors=job_spec.safetensors,
            inline_payload_max_bytes=settings.inline_payload_max_bytes,
        )
    session.commit()
    queue_job(resources.sessions, resources.celery, accepted.job)
    # Serialized here, in this thread: FastAPI would validate the model again in another thread hop.
    body = JobResponse.of(accepted.job, accepted.queue_position).model_dump_json()
    return Response(body, status_code=status.HTTP_201_CREATED, media_type="application/json")


@router.get("", responses={403: {"description": "`owner` names another owner and the key is not an admin."}})
def list_jobs(
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    status_filter: Annotated[JobStatus | None, Query(alias="status")] = None,
    model_key: str | None = None,
    owner: Annotated[
        str | None, Query(description="Only this owner's jobs (admins; others may name only themselves).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: str | None = None,
    id_prefix: IdPrefixQuery = None,
) -> JobListResponse:
    """The caller's jobs (an admin's: every owner's), newest first, a page at a time."""
    query = select(Job)
    if (listed := caller.listed_owner(owner)) is not None:
        query = query.where(Job.owner == listed)
    if id_prefix is not None:
        query = query.where(starting_with(Job.id, id_prefix))
    if status_filter is not None:
        query = query.where(Job.status == status_filter)
    if model_key is not None:
        query = query.where(Job.model_key == model_key)
    if cursor:
        try:
            query = query.where(older_than(cursor))
        except InvalidCursor as error:
            raise _invalid(("query", "cursor"), str(error), cursor) from None
    jobs = list(session.scalars(query.order_by(*NEWEST_FIRST).limit(limit + 1)))
    page, more = jobs[:limit], len(jobs) > limit
    positions = queue_positions(session, page)
    waiting = waiting_reasons(session, page, settings.worker_stale_after_s)
    return JobListResponse(
        jobs=[JobResponse.of(job, positions.get(job.id), waiting.get(job.id)) for job in page],
        next_cursor=encode_cursor(page[-1]) if more else None,
    )


@router.get("/{job_id}", responses=NOT_YOURS)
def get_job(job_id: uuid.UUID, caller: CallerDep, session: SessionDep, settings: SettingsDep) -> JobResponse:
    job = owned_or_404(session, Job, job_id, caller)
    waiting = waiting_reasons(session, [job], settings.worker_stale_after_s)
    return JobResponse.of(job, queue_positions(session, [job]).get(job.id), waiting.get(job.id))


@router.post("/{job_id}/cancel", responses={**NOT_YOURS, 409: {"description": "The job has already ended."}})
def cancel(job_id: uuid.UUID, caller: CallerDep, session: SessionDep, sessions: SessionsDep) -> JobResponse:
    """Cancel a queued or running job (a running one is aborted by its worker within a heartbeat)."""
    owned_or_404(session, Job, job_id, caller)
    return cancel_response(sessions, job_id, caller.owner, "job")


def cancel_response(sessions: sessionmaker[Session], job_id: uuid.UUID, by: str, noun: str) -> JobResponse:
    """Cancel the caller's job (a trace, or a steering job: ``noun`` names it in the 409 when it has ended)."""
    try:
        job = cancel_job(sessions, job_id, by=by)
    except InvalidTransition as refused:
        detail = f"{noun} {job_id} is {refused.current.value}; only queued or running jobs can be cancelled"
        raise HTTPException(status.HTTP_409_CONFLICT, detail) from None
    return JobResponse.of(job, None)


@router.get(
    "/{job_id}/result",
    response_model=None,
    response_class=StreamingResponse,
    responses={
        **NOT_YOURS,
        200: {"content": {"application/octet-stream": {}}, "description": "The result's bytes (inline)."},
        302: {"description": "Redirect to a presigned object-store URL."},
        409: {
            "description": "The job has no result (in that format): only completed jobs, and failed traces "
            "that saved values before their error, have one."
        },
        410: {"description": "The result was deleted (NNQUEUE_RETENTION_DAYS), or is no longer in the object store."},
    },
)
def download_result(
    job_id: uuid.UUID,
    caller: CallerDep,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    inline: bool = False,
    format: Literal["torch", "safetensors"] = "torch",  # noqa: A002 - the query parameter's name
) -> StreamingResponse | RedirectResponse:
    """The result: a redirect to a presigned URL, or its bytes when ``inline`` or the store cannot presign.

    ``torch`` is ``torch.save({name: value})``; ``safetensors`` exists when the job was submitted with
    ``safetensors: true`` and every saved value is a tensor.
    A failed trace job has a result too when its other invokes saved values before the error.
    """
    return result_response(owned_or_404(session, Job, job_id, caller), format, store, settings, inline=inline)


def result_response(
    job: Job,
    format: str,  # noqa: A002 - the query parameter's name
    store: ObjectStore,
    settings: Settings,
    *,
    inline: bool = False,
) -> StreamingResponse | RedirectResponse:
    """A completed job's result in ``format`` (``torch`` or ``safetensors``; a steering job's ``torch`` is its
    generations, JSON, and its ``safetensors`` the activations it captured): a redirect to a presigned URL, or its
    bytes when ``inline`` or the store cannot presign, with the sha256 the worker recorded
    (:func:`nnqueue.api.downloads.digest_headers`); 409 or 410 when there is none."""
    key, sha256, filename = _result_object(job, format)
    return object_response(store, key, settings.result_url_expiry_s, filename=filename, sha256=sha256, inline=inline)


def _require_trace(data: bytes) -> None:
    kind = trace_payload.payload_kind(data)
    if kind == "prebuilt":
        try:
            trace_payload.read_header(data)
        except trace_payload.PayloadError as error:
            raise _invalid(("body", "payload"), f"invalid prebuilt trace: {error}", None) from None
    elif kind is None:
        raise _invalid(
            ("body", "payload"),
            "the payload is neither an nnqueue prebuilt trace nor an nnsight serialized trace"
            " (RequestModel.serialize: pickle protocol 4, or zstd-compressed)",
            None,
        )


def _result_object(job: Job, fmt: str) -> tuple[str, str | None, str]:
    """The object key, recorded sha256 and download name of the job's result in format ``fmt``, or 409 (410 once
    deleted) when it has none."""
    if job.status not in (JobStatus.COMPLETED, JobStatus.FAILED) or job.result_key is None:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"job {job.id} is {job.status.value}; only completed jobs (and failed traces that saved values"
            " before their error) have a result",
        )
    if job.purged_at is not None:
        raise HTTPException(
            status.HTTP_410_GONE,
            f"the result of job {job.id} was deleted at {job.purged_at.isoformat(timespec='seconds')} "
            "(the server keeps results for NNQUEUE_RETENTION_DAYS after a job ends)",
        )
    steering = job.kind is JobKind.STEER
    if fmt == "torch":
        return job.result_key, job.result_sha256, f"{job.id}.{'json' if steering else 'pt'}"
    if not job.has_safetensors:
        if steering:
            why = "recorded no activations: its spec has no captures"
        elif not job.wants_safetensors:
            why = "it was not asked for (submit it with safetensors: true, client.backend(safetensors=True))"
        else:
            why = "not every saved value is a tensor"
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} has no safetensors result: {why}")
    if steering:
        key, filename = sibling_key(job.result_key, ACTIVATIONS_FILE), f"{job.id}-activations.safetensors"
    else:
        key, filename = sibling_key(job.result_key, SAFETENSORS_FILE), f"{job.id}.safetensors"
    return key, job.result_safetensors_sha256, filename


def _invalid(loc: tuple[str, ...], message: str, value: Any) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": loc, "msg": message, "input": value}])
