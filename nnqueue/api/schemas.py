"""The API's request and response bodies (pydantic), which also make up its OpenAPI schema.

A job's free-form ``metadata`` and the client's library versions are kept in the job row's JSON
column as ``meta["metadata"]`` and ``meta["client"]``; the worker reads ``meta["client"]`` to
explain a trace that this server's nnsight cannot rebuild.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nnqueue.db.models import Job, JobKind, JobStatus, as_utc

MAX_TIMEOUT_S = 86400.0
INT32 = 2**31 - 1


class ClientVersions(BaseModel):
    nnsight: str = Field(max_length=64)
    python: str = Field(max_length=64)


class JobSpec(BaseModel):
    """The ``spec`` form field of ``POST /v1/jobs``, a JSON object. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    model_key: str = Field(
        min_length=1, max_length=500, pattern=r"^[^\x00]+$", description="A model some live worker serves."
    )
    # Only traces for now: workers cannot run declarative harvest specs yet.
    kind: Literal["trace"] = "trace"
    priority: int = Field(0, ge=-INT32 - 1, le=INT32)
    timeout_s: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="Seconds the job may run; null for the server's default."
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Anything; returned with the job.")
    client: ClientVersions | None = Field(None, description="The submitting client's library versions.")


class Progress(BaseModel):
    done: int
    total: int | None


class JobError(BaseModel):
    type: str
    message: str
    traceback: str


class JobResult(BaseModel):
    size: int
    format: str = Field(description="'torch' (saves.pt), or 'torch+safetensors' when a safetensors copy exists.")


class JobResponse(BaseModel):
    id: uuid.UUID
    owner: str
    model_key: str
    kind: JobKind
    status: JobStatus
    priority: int
    timeout_s: float
    metadata: dict[str, Any]
    attempts: int
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    purged_at: datetime | None = Field(
        description="When the payload and result were deleted (NNQUEUE_RETENTION_DAYS after the job ended); null while kept."
    )
    queue_position: int | None = Field(description="1-based place among the model's queued jobs; null unless queued.")
    progress: Progress
    error: JobError | None
    result: JobResult | None

    @classmethod
    def of(cls, job: Job, queue_position: int | None) -> JobResponse:
        return cls(
            id=job.id,
            owner=job.owner,
            model_key=job.model_key,
            kind=job.kind,
            status=job.status,
            priority=job.priority,
            timeout_s=job.timeout_s,
            metadata=job.meta.get("metadata", {}),
            attempts=job.attempts,
            created_at=as_utc(job.created_at),
            queued_at=as_utc(job.queued_at),
            started_at=as_utc(job.started_at),
            finished_at=as_utc(job.finished_at),
            purged_at=as_utc(job.purged_at),
            queue_position=queue_position,
            progress=Progress(done=job.progress_done, total=job.progress_total),
            error=_error(job),
            result=_result(job),
        )


class JobListResponse(BaseModel):
    jobs: list[JobResponse]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next (older) page; null on the last page.")


class ModelInfo(BaseModel):
    model_key: str
    workers: int
    capacity: int = Field(description="Jobs the live workers run at once, summed.")
    engine: str = Field(
        description="The engine the workers hold: 'vllm' (VLLM traces) or 'transformers' (LanguageModel)."
    )


class ModelsResponse(BaseModel):
    models: list[ModelInfo]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready", "unavailable"]
    checks: dict[str, str] = Field(description="'ok', or the error, for database, broker and object_store.")
    store: str = Field(description="The object store in use: 's3://<bucket> at <endpoint>' or 'local folder <path>'.")


def _error(job: Job) -> JobError | None:
    if job.error_type is None:
        return None
    return JobError(type=job.error_type, message=job.error_message or "", traceback=job.error_traceback or "")


def _result(job: Job) -> JobResult | None:
    if job.result_key is None or job.result_size is None or job.result_format is None:
        return None
    return JobResult(size=job.result_size, format=job.result_format)
