"""``/v1/harvests``: submit a declarative harvest, follow it, cancel it, read its manifest, fetch its shards.

Like jobs, every route sees only the caller's own harvests (another owner's answers 404) unless the key has
the ``admin`` scope; submitting needs the ``harvest`` scope (a default key's), the other routes ``harvest`` or ``admin``. A submission is
a multipart form: ``spec`` (the JSON :class:`~nnqueue.scheduler.harvest_spec.HarvestSpec`) and optionally
``dataset``, a file stored under the caller's prefix and harvested. Every refusal is a 4xx with its reason:
422 (bad spec, unknown module with the valid ones, empty dataset, missing column), 400 (no live worker),
403 (a file outside the caller's prefix), 404 (no such file), 413 (too large). ``POST /v1/harvests/estimate``
takes the same form and answers the harvest's estimated size and duration, storing and queueing nothing. A submission is one
transaction on the request's session (the harvest and its chunks), then its chunk tokens.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, HTTPException, Path, Query, UploadFile, status
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from nnqueue import metrics
from nnqueue.api.deps import (
    Caller,
    HarvestCallerDep,
    HarvestReaderDep,
    ResourcesDep,
    SessionDep,
    SessionsDep,
    SettingsDep,
    StoreDep,
)
from nnqueue.api.downloads import object_response
from nnqueue.api.ownership import owned_or_404
from nnqueue.api.pagination import IdPrefixQuery
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import HarvestListResponse, HarvestResponse, ShardFile, ShardList, parse_spec_field
from nnqueue.db.models import Harvest, HarvestChunk, JobStatus
from nnqueue.scheduler.chunks import cancel_harvest
from nnqueue.scheduler.harvest_dataset import Limits
from nnqueue.scheduler.harvest_estimate import HarvestEstimate
from nnqueue.scheduler.harvest_spec import HarvestRejected, HarvestSpec
from nnqueue.scheduler.harvests import (
    Submission,
    Upload,
    accept_harvest,
    estimate_harvest,
    progress,
    queue_harvest,
    recent_harvests,
)
from nnqueue.scheduler.weights import waiting_reasons
from nnqueue.settings import Settings
from nnqueue.storage.keys import harvest_key, shard_name
from nnqueue.storage.object_store import PresignUnsupported

router = APIRouter(prefix="/v1/harvests", tags=["harvests"], route_class=ReleasingRoute)
NOT_YOURS: dict[int | str, dict[str, Any]] = {404: {"description": "No such harvest, or another owner's."}}
NOT_COMPLETED: dict[int | str, dict[str, Any]] = {409: {"description": "The harvest has not completed."}}
SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "No live worker serves the model, or its workers run no harvests."},
    403: {"description": "The dataset names a file outside the caller's prefix users/<owner>/."},
    404: {"description": "The dataset's file is not in the object store."},
    413: {
        "description": "The dataset is over NNQUEUE_HARVEST_MAX_DATASET_BYTES or NNQUEUE_HARVEST_MAX_PROMPTS, "
        "the upload over NNQUEUE_MAX_PAYLOAD_BYTES, or the estimated output over NNQUEUE_HARVEST_MAX_OUTPUT_BYTES "
        "(the reason gives the estimate)."
    },
}


@router.post("", status_code=status.HTTP_201_CREATED, responses=SUBMIT_ERRORS)
def submit(
    caller: HarvestCallerDep,
    resources: ResourcesDep,
    session: SessionDep,
    spec: Annotated[str, Form(description="The harvest spec, a JSON object (see docs/user/harvests.md).")],
    dataset: Annotated[UploadFile | None, File(description="A JSONL, Parquet or text file to harvest.")] = None,
) -> HarvestResponse:
    """Check the spec, freeze the dataset, and queue the harvest's chunks on the model's bulk queue."""
    harvest_spec = parse_spec_field(spec, HarvestSpec)
    submission = _submission(caller, resources.settings, dataset)
    try:
        harvest = accept_harvest(session, resources.store, harvest_spec, submission)
    except HarvestRejected as rejected:
        raise HTTPException(rejected.status, rejected.reason) from None
    view = _view(session, harvest)
    session.commit()
    queue_harvest(resources.celery, harvest)
    metrics.HARVESTS_SUBMITTED.labels(harvest.model_key).inc()
    return view


@router.post("/estimate", responses=SUBMIT_ERRORS)
def estimate(
    caller: HarvestCallerDep,
    resources: ResourcesDep,
    session: SessionDep,
    spec: Annotated[str, Form(description="The harvest spec, a JSON object, as for a submission.")],
    dataset: Annotated[UploadFile | None, File(description="A JSONL, Parquet or text file to harvest.")] = None,
) -> HarvestEstimate:
    """A dry run: the tokens, rows, bytes, shards and duration the harvest would take, checked as a submission
    is, with nothing stored or queued."""
    harvest_spec = parse_spec_field(spec, HarvestSpec)
    try:
        return estimate_harvest(
            session, resources.store, harvest_spec, _submission(caller, resources.settings, dataset)
        )
    except HarvestRejected as rejected:
        raise HTTPException(rejected.status, rejected.reason) from None


def _submission(caller: Caller, settings: Settings, dataset: UploadFile | None) -> Submission:
    """``caller``'s submission, with the uploaded ``dataset`` read (one byte over the limit, to refuse it)."""
    upload = None
    if dataset is not None:
        upload = Upload(dataset.filename or "dataset", dataset.file.read(settings.harvest_max_dataset_bytes + 1))
    return Submission(
        owner=caller.owner,
        limits=Limits.of(settings),
        stale_after_s=settings.worker_stale_after_s,
        api_key_id=caller.key_id,
        upload=upload,
        max_output_bytes=settings.harvest_max_output_bytes,
        restart_grace_s=settings.worker_restart_grace_s,
        scale_to_zero_models=tuple(settings.scale_to_zero_models),
    )


@router.get("", responses={403: {"description": "`owner` names another owner and the key is not an admin."}})
def list_harvests(
    caller: HarvestReaderDep,
    session: SessionDep,
    settings: SettingsDep,
    status_filter: Annotated[JobStatus | None, Query(alias="status")] = None,
    owner: Annotated[
        str | None, Query(description="Only this owner's harvests (admins; others may name only themselves).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    id_prefix: IdPrefixQuery = None,
) -> HarvestListResponse:
    """The caller's harvests (an admin's: every owner's), newest first."""
    harvests = recent_harvests(session, caller.listed_owner(owner), status_filter, limit, id_prefix)
    done = progress(session, harvests)
    waiting = waiting_reasons(session, harvests, settings.worker_stale_after_s)
    return HarvestListResponse(
        harvests=[HarvestResponse.of(harvest, done[harvest.id], waiting.get(harvest.id)) for harvest in harvests]
    )


@router.get("/{harvest_id}", responses=NOT_YOURS)
def get_harvest(
    harvest_id: uuid.UUID, caller: HarvestReaderDep, session: SessionDep, settings: SettingsDep
) -> HarvestResponse:
    harvest = owned_or_404(session, Harvest, harvest_id, caller)
    waiting = waiting_reasons(session, [harvest], settings.worker_stale_after_s)
    return HarvestResponse.of(harvest, progress(session, [harvest])[harvest.id], waiting.get(harvest.id))


@router.post("/{harvest_id}/cancel", responses={**NOT_YOURS, 409: {"description": "The harvest has ended."}})
def cancel(
    harvest_id: uuid.UUID, caller: HarvestReaderDep, session: SessionDep, sessions: SessionsDep
) -> HarvestResponse:
    """Cancel the harvest: queued chunks never run, running ones are aborted by their workers within a heartbeat."""
    harvest = owned_or_404(session, Harvest, harvest_id, caller)
    session.commit()
    if not cancel_harvest(sessions, harvest_id):
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"harvest {harvest_id} is {harvest.status.value}; it cannot be cancelled"
        )
    return _view(session, owned_or_404(session, Harvest, harvest_id, caller))


@router.get("/{harvest_id}/manifest", responses={**NOT_YOURS, **NOT_COMPLETED})
def manifest(harvest_id: uuid.UUID, caller: HarvestReaderDep, session: SessionDep, store: StoreDep) -> Response:
    """``manifest.json``: the spec, model, versions, dataset digest, and every shard's rows, bytes, sha256 and
    per-prompt row offsets."""
    harvest = _completed(session, harvest_id, caller)
    assert harvest.manifest_key is not None
    return Response(store.get_bytes(harvest.manifest_key), media_type="application/json")


@router.get("/{harvest_id}/shards", responses={**NOT_YOURS, **NOT_COMPLETED})
def shards(
    harvest_id: uuid.UUID, caller: HarvestReaderDep, session: SessionDep, settings: SettingsDep, store: StoreDep
) -> ShardList:
    """Every shard with its size and sha256, and a URL to GET it: presigned (S3), else this API's own route."""
    harvest = _completed(session, harvest_id, caller)
    chunks = session.scalars(
        select(HarvestChunk).where(HarvestChunk.harvest_id == harvest.id).order_by(HarvestChunk.index)
    )
    files = []
    for chunk in chunks:
        try:
            url = store.presigned_get_url(chunk.shard_key, settings.result_url_expiry_s)
        except PresignUnsupported:
            url = f"/v1/harvests/{harvest.id}/shards/{chunk.index}"
        files.append(
            ShardFile(
                name=shard_name(chunk.index),
                index=chunk.index,
                rows=chunk.rows or 0,
                bytes=chunk.bytes or 0,
                sha256=chunk.sha256 or "",
                url=url,
            )
        )
    return ShardList(shards=files)


@router.get(
    "/{harvest_id}/shards/{index}",
    response_model=None,
    responses={
        **NOT_YOURS,
        **NOT_COMPLETED,
        200: {"content": {"application/octet-stream": {}}, "description": "The shard's bytes (inline)."},
        302: {"description": "Redirect to a presigned URL."},
        410: {"description": "The shard is no longer in the object store."},
    },
)
def shard(
    harvest_id: uuid.UUID,
    index: Annotated[int, Path(ge=0)],
    caller: HarvestReaderDep,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    inline: bool = False,
) -> Response:
    """One shard: a redirect to a presigned URL, or its bytes (``inline``, or a store that cannot presign)."""
    harvest = _completed(session, harvest_id, caller)
    if not 0 <= index < harvest.chunks_total:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"harvest {harvest_id} has shards 0 to {harvest.chunks_total - 1}"
        )
    key = harvest_key(harvest.id, shard_name(index))
    sha256 = session.scalar(
        select(HarvestChunk.sha256).where(HarvestChunk.harvest_id == harvest.id, HarvestChunk.index == index)
    )
    expiry_s = settings.result_url_expiry_s
    return object_response(
        store, key, expiry_s, filename=shard_name(index), sha256=sha256, inline=inline, what="the shard"
    )


def _completed(session: Session, harvest_id: uuid.UUID, caller: Caller) -> Harvest:
    harvest = owned_or_404(session, Harvest, harvest_id, caller)
    if harvest.status is not JobStatus.COMPLETED or harvest.manifest_key is None:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"harvest {harvest_id} is {harvest.status.value}; only completed harvests have shards",
        )
    return harvest


def _view(session: Session, harvest: Harvest) -> HarvestResponse:
    return HarvestResponse.of(harvest, progress(session, [harvest])[harvest.id])
