"""nnsight's ``remote=True`` protocol under ``/ndif``: users set ``NDIF_HOST=<api>/ndif`` and ``NDIF_API_KEY``.

What nnsight 0.8.1's ``RemoteBackend`` speaks (see ``shared/docs/nnsight-remote-protocol.md``):

* ``WS /ndif/subscribe``: the first frame is ``{"session_id": ...}``; then the client POSTs its request with
  that id, and gets its job's status updates (nnsight's ``ResponseModel`` as JSON text frames) until
  COMPLETED (``data``: a URL of the result) or ERROR. Every subscription ends in one of them
  (:func:`nnqueue.api.nnsight_jobs.follow`). The handshake carries the key (``ndif-api-key``, which nnsight's
  client sends whenever ``NDIF_API_KEY`` is set): a missing or unknown key, one without the ``trace`` scope,
  and a key or server over its limit of open subscriptions (:mod:`nnqueue.api.subscriptions`) are refused
  with 401, 403 or 429 and a JSON ``detail`` (the client shows it in its ``WebSocketBadStatusException``).
* ``POST /ndif/request``: multipart, ``data`` (JSON ``RequestModel``: model key, session id, compress, env) and
  ``blob`` (the serialized trace), the key in ``ndif-api-key``. Answers RECEIVED with the job id, or an error
  whose ``detail`` nnsight shows (``RemoteError: Failed to send request: <detail>``).
* ``GET /ndif/response/{id}``: the job's current status (non-blocking clients poll it; 404 while unknown).
* ``GET /ndif/result/{id}?expires=&compress=&sig=``: the result's bytes for a signed URL, no key needed,
  zstd-compressed (with the content size in the frame header) when the client compresses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import IO, Annotated, Any, cast

from fastapi import APIRouter, File, Form, Header, HTTPException, Request, UploadFile, WebSocket, status
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.websockets import WebSocketDisconnect

from nnqueue.api import nnsight_protocol as protocol
from nnqueue.api.deps import (
    CallerDep,
    Resources,
    ResourcesDep,
    SessionDep,
    SessionsDep,
    SettingsDep,
    StoreDep,
    TraceCallerDep,
    caller_of,
    check_scope,
)
from nnqueue.api.downloads import STREAM_CHUNK, read_chunks
from nnqueue.api.job_watch import JobWatcher
from nnqueue.api.limits import payload_too_large
from nnqueue.api.nnsight_jobs import NnsightRequest, follow, orphan_grace_s, result_url, submit_nnsight
from nnqueue.api.ownership import owned_or_404
from nnqueue.api.refusals import refusals_as_http
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.subscriptions import Subscriptions
from nnqueue.db.models import Job, JobStatus
from nnqueue.scheduler.positions import queue_positions
from nnqueue.storage.object_store import ObjectNotFound, ObjectReader

log = logging.getLogger(__name__)
router = APIRouter(prefix="/ndif", tags=["nnsight remote"], route_class=ReleasingRoute)
# How long a subscription waits for its POST (the client's own read timeout for it).
ARRIVAL_TIMEOUT_S = 600.0


@router.post("/request")
def submit_request(
    caller: TraceCallerDep,
    resources: ResourcesDep,
    data: Annotated[str, Form(description="nnsight's RequestModel as JSON: model_key, session_id, compress, env.")],
    blob: Annotated[UploadFile, File(description="RequestModel.serialize(tracer): the trace, maybe zstd.")],
    nnsight_version: Annotated[str | None, Header(alias="nnsight-version")] = None,
    python_version: Annotated[str | None, Header(alias="python-version")] = None,
) -> dict[str, Any]:
    """Queue an nnsight trace; answers nnsight's ResponseModel, RECEIVED with the job's id."""
    envelope = _envelope(data)
    limit = resources.settings.max_payload_bytes
    payload = blob.file.read(limit + 1)
    if len(payload) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, payload_too_large(limit))
    session_id = envelope["session_id"]
    request = NnsightRequest(
        nnsight_key=envelope["model_key"],
        model_key=None,
        blob=payload,
        compress=envelope["compress"],
        env=envelope["env"],
        versions=protocol.client_versions(nnsight_version, python_version),
        protocol="remote",
    )
    with refusals_as_http():
        job_id = protocol.job_id_for_session(session_id) if session_id else None
        job = submit_nnsight(resources, caller, request, job_id)
    return protocol.response(job, status="RECEIVED", description=f"queued for {job.model_key}")


def _envelope(data: str) -> dict[str, Any]:
    try:
        raw = json.loads(data)
    except ValueError:
        raw = None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_key"), str):
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST, "data must be nnsight's RequestModel as JSON, with a model_key"
        )
    session_id, compress, env = raw.get("session_id", ""), raw.get("compress", False), raw.get("env", {})
    if not isinstance(session_id, str) or not isinstance(compress, bool) or not isinstance(env, dict):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "session_id must be a string, compress a bool, env an object")
    return {"model_key": raw["model_key"], "session_id": session_id, "compress": compress, "env": env}


@router.get(
    "/response/{job_id}",
    responses={404: {"description": "No such job (yet), or another owner's (unless an admin asks)."}},
)
def get_response(
    job_id: uuid.UUID,
    request: Request,
    caller: CallerDep,
    session: SessionDep,
    sessions: SessionsDep,
    settings: SettingsDep,
    store: StoreDep,
) -> dict[str, Any]:
    """The job's status as nnsight's ResponseModel; COMPLETED carries the result URL."""
    job = owned_or_404(session, Job, job_id, caller)
    if job.status is JobStatus.COMPLETED:
        url = result_url(str(request.base_url), store, sessions, settings, job)
        return protocol.response(job, data=url)
    return protocol.response(job, position=queue_positions(session, [job]).get(job.id))


@router.get(
    "/result/{job_id}",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "torch.save of the saves, maybe zstd."},
        403: {"description": "The signature is wrong or has expired."},
        410: {"description": "The result was deleted."},
    },
)
def download(
    job_id: uuid.UUID, expires: int, compress: int, sig: str, session: SessionDep, store: StoreDep
) -> StreamingResponse:
    """The result for a signed URL (from COMPLETED or /response): no API key, the signature is the permission."""
    job = session.get(Job, job_id)
    if job is None or not protocol.verify_result(protocol.signing_key(job), job_id, expires, bool(compress), sig):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "invalid or expired result URL; ask /ndif/response for a new one"
        )
    if job.result_key is None or job.purged_at is not None:
        raise HTTPException(status.HTTP_410_GONE, f"job {job_id} has no result any more")
    try:
        size = store.size(job.result_key)
        reader = store.open_stream(job.result_key)
    except ObjectNotFound:
        raise HTTPException(status.HTTP_410_GONE, "the result is no longer in the object store") from None
    if compress:
        return StreamingResponse(_compressed(reader, size), media_type="application/octet-stream")
    return StreamingResponse(
        read_chunks(reader), media_type="application/octet-stream", headers={"Content-Length": str(size)}
    )


def _compressed(reader: ObjectReader, size: int) -> Iterator[bytes]:
    """One zstd frame whose header holds the content size (nnsight's client decompresses in one shot)."""
    import zstandard

    with reader:
        yield from zstandard.ZstdCompressor(level=3).read_to_iter(
            cast("IO[bytes]", reader), size=size, read_size=STREAM_CHUNK, write_size=STREAM_CHUNK
        )


@router.websocket("/subscribe")
async def subscribe(websocket: WebSocket) -> None:
    """Check the key, hand out a session id, then stream the status of the job POSTed with it until it ends."""
    resources: Resources = websocket.app.state.resources
    try:
        caller = await caller_of(resources, websocket.headers.get("ndif-api-key"))
        check_scope(caller, "trace")
    except HTTPException as refused:
        await _deny(websocket, refused.status_code, str(refused.detail))
        return
    subscriptions: Subscriptions = websocket.app.state.subscriptions
    with subscriptions.hold(caller.key_id) as refusal:
        if refusal is not None:
            await _deny(websocket, status.HTTP_429_TOO_MANY_REQUESTS, refusal)
            return
        await _subscribed(websocket, resources)


async def _deny(websocket: WebSocket, status_code: int, detail: str) -> None:
    """Refuse the handshake with ``status_code`` and ``{"detail": ...}`` (a plain 403 where the server cannot
    send a response to a websocket handshake)."""
    try:
        await websocket.send_denial_response(JSONResponse({"detail": detail}, status_code=status_code))
    except RuntimeError:
        await websocket.close(status.WS_1008_POLICY_VIOLATION, detail[:120])


async def _subscribed(websocket: WebSocket, resources: Resources) -> None:
    watcher: JobWatcher = websocket.app.state.job_watcher
    await websocket.accept()
    session_id = protocol.new_session_id()
    job_id = protocol.job_id_for_session(session_id)
    await websocket.send_json({"session_id": session_id})
    receiving = asyncio.ensure_future(websocket.receive())

    async def left() -> bool:
        nonlocal receiving
        while receiving.done():
            if receiving.exception() is not None or receiving.result().get("type") == "websocket.disconnect":
                return True
            receiving = asyncio.ensure_future(websocket.receive())  # the client sent something: ignore it
        return False

    try:
        await _stream(websocket, resources, watcher, job_id, left)
    except WebSocketDisconnect:
        pass
    except Exception as error:  # the client has no timeout: tell it, rather than leave it waiting
        log.exception("subscription of job %s failed", job_id)
        await _send_final(websocket, {"id": str(job_id), "status": "ERROR", "description": f"server error: {error}"})
    finally:
        receiving.cancel()


async def _stream(
    websocket: WebSocket,
    resources: Resources,
    watcher: JobWatcher,
    job_id: uuid.UUID,
    left: Callable[[], Awaitable[bool]],
) -> None:
    settings = resources.settings
    last: tuple[str, str] | None = None
    updates = follow(
        watcher,
        resources.sessions,
        job_id,
        orphan_grace_s=orphan_grace_s(settings),
        left=left,
        arrival_timeout_s=ARRIVAL_TIMEOUT_S,
    )
    async for seen in updates:
        if seen is None:
            continue
        job = seen.job
        if job.status is JobStatus.COMPLETED:
            base = _http_base(websocket)
            url = await asyncio.to_thread(result_url, base, resources.store, resources.sessions, settings, job)
            await _send_final(websocket, protocol.response(job, data=url))
            return
        update = protocol.response(job, position=seen.position)
        if update["status"] == "ERROR":
            await _send_final(websocket, update)
            return
        if (update["status"], update["description"]) != last:
            last = (update["status"], update["description"])
            await websocket.send_text(json.dumps(update))
    if not await left():
        await _send_final(
            websocket,
            {
                "id": str(job_id),
                "status": "ERROR",
                "description": f"no request arrived for this session within {ARRIVAL_TIMEOUT_S:g} s",
            },
        )


async def _send_final(websocket: WebSocket, update: dict[str, Any]) -> None:
    try:
        await websocket.send_text(json.dumps(update))
        await websocket.close()
    except (WebSocketDisconnect, RuntimeError):
        pass  # the client is gone already


def _http_base(websocket: WebSocket) -> str:
    """The API's base URL as the client reached it (ws -> http, wss -> https)."""
    base = websocket.base_url
    return str(base.replace(scheme="https" if base.scheme == "wss" else "http"))
