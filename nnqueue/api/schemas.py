"""The API's request and response bodies (pydantic), which also make up its OpenAPI schema.

A job's free-form ``metadata`` and the client's library versions are kept in the job row's JSON
column as ``meta["metadata"]`` and ``meta["client"]``; the worker reads ``meta["client"]`` to
explain a trace that this server's nnsight cannot rebuild.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, Literal, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nnqueue.api.routing import strict_loads
from nnqueue.db.models import Harvest, HarvestSchedule, Job, JobKind, JobStatus
from nnqueue.scheduler.harvest_spec import HarvestSpec
from nnqueue.scheduler.harvests import HarvestProgress

MAX_TIMEOUT_S = 86400.0
INT32 = 2**31 - 1
M = TypeVar("M", bound=BaseModel)


def parse_spec_field(text: str, model: type[M], loc: tuple[str, ...] = ("body", "spec")) -> M:
    """A spec, a JSON object (a multipart form's ``spec`` field, or the header ``loc`` names), as ``model``; a 422
    naming what is wrong (under ``loc``) otherwise. Strict JSON: NaN and Infinity are refused (a database's JSON
    column refuses them)."""
    try:
        data = strict_loads(text)
    except RecursionError:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": loc, "msg": "nested too deeply", "input": text[:200]}]
        ) from None
    except json.JSONDecodeError as error:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": loc, "msg": f"not JSON: {error}", "input": text[:200]}]
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        errors = [{**e, "loc": (*loc, *e["loc"])} for e in error.errors(include_url=False, include_input=False)]
        raise RequestValidationError(errors) from None


class ClientVersions(BaseModel):
    nnsight: str = Field(max_length=64)
    python: str = Field(max_length=64)


class JobSpec(BaseModel):
    """The ``spec`` form field of ``POST /v1/jobs``, a JSON object. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    model_key: str = Field(
        min_length=1, max_length=500, pattern=r"^[^\x00]+$", description="A model some live worker serves."
    )
    # Only traces: declarative harvests are submitted to POST /v1/harvests.
    kind: Literal["trace"] = "trace"
    priority: int = Field(
        0, ge=-INT32 - 1, le=INT32, description="Higher runs earlier: a model's queued jobs run by priority, then age."
    )
    timeout_s: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_S, description="Seconds the job may run; null for the server's default."
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Anything; returned with the job.")
    client: ClientVersions | None = Field(None, description="The submitting client's library versions.")
    weights_version: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="Run only on an engine serving this weights version, or 'latest' (resolved at submit); "
        "null: any (docs/user/weights.md).",
    )
    safetensors: bool = Field(
        False,
        description="Also write the result as safetensors (when every saved value is a tensor), for readers "
        "without torch: a second copy of every saved byte, so off unless asked.",
    )


class Progress(BaseModel):
    done: int
    total: int | None


class JobError(BaseModel):
    type: str
    message: str
    traceback: str


class ObjectDigest(BaseModel):
    size: int
    sha256: str | None = Field(description="Hex sha256 of the object as the worker stored it; null for older jobs.")


class JobResult(BaseModel):
    size: int
    format: str = Field(description="'torch' (saves.pt), or 'torch+safetensors' when a safetensors copy exists.")
    sha256: str | None = Field(
        None, description="Hex sha256 of saves.pt as the worker stored it (clients check downloads against it)."
    )
    safetensors: ObjectDigest | None = Field(None, description="The safetensors copy's size and sha256, if any.")


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
    queue_position: int | None = Field(
        description="1-based place among the model's queued jobs in the order workers take them (owners in turns);"
        " null unless queued."
    )
    progress: Progress
    error: JobError | None
    result: JobResult | None
    weights_pin: str | None = Field(None, description="The weights version the job must run on; null: any.")
    weights_version: str | None = Field(None, description="The weights version the job ran on (once it ended).")
    waiting_reason: str | None = Field(None, description="Why a queued job cannot run now (its pinned version).")
    domain: str | None = Field(
        None, description="The trust domain the job is in (its owner's): a trace runs only on an engine serving it."
    )

    @classmethod
    def of(cls, job: Job, queue_position: int | None, waiting_reason: str | None = None) -> JobResponse:
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
            created_at=job.created_at,
            queued_at=job.queued_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            purged_at=job.purged_at,
            queue_position=queue_position,
            progress=Progress(done=job.progress_done, total=job.progress_total),
            error=_error(job),
            result=_result(job),
            weights_pin=job.weights_pin,
            weights_version=job.weights_version,
            waiting_reason=waiting_reason,
            domain=job.domain,
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
    weights_versions: dict[str, int] = Field(
        default_factory=dict, description="The weights versions the live workers serve, each with its workers."
    )
    taps: list[str] | None = Field(
        None,
        description="The locations the workers serve with CUDA graphs on (nnqueue worker --taps), the ones every"
        " tapped worker serves; a trace touching any other fails. Null: the workers run eagerly, every location.",
    )
    domains: list[str] = Field(
        default_factory=list,
        description="The trust domains whose traces the live workers' engines run now (those that ran any); a domain"
        " the caller is not in is named 'other' unless the key has the admin scope.",
    )


class ModelsResponse(BaseModel):
    models: list[ModelInfo]


class DomainsResponse(BaseModel):
    mode: str = Field(description="NNQUEUE_TRUST_DOMAINS: 'owner' (each owner alone, or in a group) or 'deployment'.")
    domain: str = Field(description="The caller's trust domain: their traces share engines with its owners' only.")
    members: list[str] = Field(
        description="The owners in the caller's domain (the caller alone unless grouped); empty when the domain is"
        " the whole deployment's."
    )
    groups: dict[str, list[str]] | None = Field(
        None, description="Every named group and its owners; for keys with the admin scope only."
    )


class DomainChange(BaseModel):
    domain: str = Field(description="The group to put the owner in: 1 to 64 letters, digits, '.', '_' or '-'.")


class OwnerDomain(BaseModel):
    owner: str
    domain: str = Field(description="The owner's trust domain now.")
    moved_jobs: int = Field(
        description="The owner's queued jobs that moved with them (running ones finish where they are)."
    )


class WeightsUpdateRequest(BaseModel):
    """The body of ``POST /v1/models/{model_key}/weights``: a checkpoint swap (docs/user/weights.md)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        min_length=1,
        max_length=2048,
        description="s3://<the store's bucket>/<key> of a .safetensors file, or an absolute path (a file, or a "
        "folder of .safetensors files) on the workers' hosts.",
    )
    tensors: list[str] | None = Field(
        None, max_length=100_000, description="Load only these tensors (checkpoint names); null: every tensor."
    )


class WorkerWeights(BaseModel):
    worker_id: str
    version: str | None
    since: datetime | None
    source: dict[str, Any] | None = Field(description="Where the version came from; 'error' if an update failed.")


class WeightsUpdateView(BaseModel):
    id: int
    version: str
    source: str
    tensors: list[str] | None
    owner: str
    created_at: datetime


class ModelWeightsResponse(BaseModel):
    model_key: str
    workers: list[WorkerWeights]
    updates: list[WeightsUpdateView]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


IsolationSummary = Literal["full", "degraded", "no live worker"]


class ReadyResponse(BaseModel):
    status: Literal["ready", "unavailable"]
    checks: dict[str, str] = Field(description="'ok', or the error, for database, broker and object_store.")
    store: str = Field(description="The object store in use: 's3://<bucket> at <endpoint>' or 'local folder <path>'.")
    engines: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="Per live worker id: what its engine processes run under (engine_user: the account, or"
        " 'kept <user>'; note: why; seccomp: 'applied' or why not; network; filesystem; isolation: 'full' or"
        " 'degraded: <why>'; traces: whose traces it runs). See docs/operator/engine-isolation.md.",
    )
    isolation: IsolationSummary = Field(
        "no live worker",
        description="'full' when every live worker's engine is fully isolated, 'degraded' when any is not (that"
        " worker runs only its operator's traces; still ready), 'no live worker'.",
    )


def _error(job: Job) -> JobError | None:
    if job.error_type is None:
        return None
    return JobError(type=job.error_type, message=job.error_message or "", traceback=job.error_traceback or "")


def _result(job: Job) -> JobResult | None:
    if job.result_key is None or job.result_size is None or job.result_format is None:
        return None
    safetensors = None
    if job.result_safetensors_size is not None:
        safetensors = ObjectDigest(size=job.result_safetensors_size, sha256=job.result_safetensors_sha256)
    return JobResult(size=job.result_size, format=job.result_format, sha256=job.result_sha256, safetensors=safetensors)


class HarvestError(BaseModel):
    type: str
    message: str


class HarvestResponse(BaseModel):
    id: uuid.UUID
    owner: str
    model_key: str
    status: JobStatus
    priority: int
    spec: dict[str, Any]
    dataset_digest: str = Field(description="sha256 of the frozen dataset (harvests/<id>/dataset.jsonl).")
    schedule_id: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: HarvestProgress
    error: HarvestError | None
    manifest_key: str | None = Field(description="harvests/<id>/manifest.json once completed.")
    weights_pin: str | None = Field(None, description="The weights version its chunks must run on; null: any.")
    waiting_reason: str | None = Field(
        None, description="Why its chunks cannot run now (no live worker serves its pinned version)."
    )

    @classmethod
    def of(cls, harvest: Harvest, progress: HarvestProgress, waiting_reason: str | None = None) -> HarvestResponse:
        error = None
        if harvest.error_type is not None:
            error = HarvestError(type=harvest.error_type, message=harvest.error_message or "")
        return cls(
            id=harvest.id,
            owner=harvest.owner,
            model_key=harvest.model_key,
            status=harvest.status,
            priority=harvest.priority,
            spec=harvest.spec,
            dataset_digest=harvest.dataset_digest,
            schedule_id=harvest.schedule_id,
            created_at=harvest.created_at,
            started_at=harvest.started_at,
            finished_at=harvest.finished_at,
            progress=progress,
            error=error,
            manifest_key=harvest.manifest_key,
            weights_pin=harvest.weights_pin,
            waiting_reason=waiting_reason,
        )


class HarvestListResponse(BaseModel):
    harvests: list[HarvestResponse]


class ShardFile(BaseModel):
    name: str
    index: int
    rows: int
    bytes: int
    sha256: str
    url: str = Field(description="A presigned object-store URL, or this API's own download route.")


class ShardList(BaseModel):
    shards: list[ShardFile]


class ScheduleCreate(BaseModel):
    """A recurring harvest: ``spec`` runs at each time ``cron`` names (five fields, or six with seconds last)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    cron: str = Field(min_length=1, max_length=200, description="e.g. '0 3 * * *' (03:00 UTC daily).")
    spec: HarvestSpec


class ScheduleResponse(BaseModel):
    id: int
    owner: str
    name: str
    cron: str
    spec: dict[str, Any]
    paused: bool
    next_run_at: datetime
    last_run_at: datetime | None
    last_harvest_id: uuid.UUID | None
    last_error: str | None
    runs: int
    created_at: datetime

    @classmethod
    def of(cls, schedule: HarvestSchedule) -> ScheduleResponse:
        return cls(
            id=schedule.id,
            owner=schedule.owner,
            name=schedule.name,
            cron=schedule.cron,
            spec=schedule.spec,
            paused=schedule.paused,
            next_run_at=schedule.next_run_at,
            last_run_at=schedule.last_run_at,
            last_harvest_id=schedule.last_harvest_id,
            last_error=schedule.last_error,
            runs=schedule.runs,
            created_at=schedule.created_at,
        )


class ScheduleListResponse(BaseModel):
    schedules: list[ScheduleResponse]
