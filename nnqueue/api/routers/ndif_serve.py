"""nnsight-serve's protocol per model: ``model.trace(..., serve="<api>/ndif/serve/<model key>", api_key=...)``.

What nnsight 0.8.1's ``LocalServeBackend`` speaks, for each model nnqueue serves:

* ``GET /ndif/serve/<model key>/health``: ``{"status": "ok"}`` while a live vLLM worker serves it, else 503.
* ``POST /ndif/serve/<model key>/v1/nnsight/generate``: the raw serialized trace as the body, the key in
  ``ndif-api-key``. The trace is queued like any job and the request blocks until it ends (the client reads
  for 600 s); the answer is nnsight-serve's ``torch.save({"saves": ..., "error": ...})``, assembled from the
  result the engine wrote without loading it (:mod:`nnqueue.api.serve_reply`). A failed trace answers 200
  with its error, which the client re-raises with its type; a refused one a 4xx whose ``detail`` nnsight
  shows (``ConnectionError: nnsight-serve returned <code>: <detail>``). A client that disconnects cancels its job.
* ``POST .../v1/nnsight/register/{id}`` (and ``/clear``): refused. nnsight-serve installs such an edit for
  every request of its engine, which on a shared engine would run one user's code in everyone's requests.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Request, status
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from nnqueue.api import nnsight_protocol as protocol
from nnqueue.api.deps import ResourcesDep, SessionDep, SettingsDep, TraceCallerDep
from nnqueue.api.downloads import read_chunks
from nnqueue.api.job_watch import JobWatcher
from nnqueue.api.limits import payload_too_large
from nnqueue.api.nnsight_jobs import NnsightRequest, follow, orphan_grace_s, submit_nnsight
from nnqueue.api.refusals import refusals_as_http
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.serve_reply import UnexpectedResult, serve_reply
from nnqueue.db.models import ENDED, EngineKind
from nnqueue.scheduler.registry import live_engines

router = APIRouter(prefix="/ndif/serve", tags=["nnsight serve"], route_class=ReleasingRoute)
REGISTER_REFUSED = (
    "nnqueue serves shared engines: an edit registered for the whole engine (model.edit(serve=...), "
    "/v1/nnsight/register) would run in every user's requests, so it is refused; put the edit inside your trace"
)


@router.get("/{model_key:path}/health", responses={503: {"description": "No live vLLM worker serves the model."}})
def health(model_key: str, session: SessionDep, settings: SettingsDep) -> dict[str, str]:
    """``{"status": "ok"}`` while a live vLLM worker serves the model."""
    engines = live_engines(session, model_key, settings.worker_stale_after_s)
    if EngineKind.VLLM.value not in engines:
        served = f" (it is served by a {', '.join(sorted(engines))} engine)" if engines else ""
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"no live vLLM worker serves {model_key!r}{served}")
    return {"status": "ok"}


@router.post("/{model_key:path}/v1/nnsight/generate", response_class=StreamingResponse)
async def generate(
    model_key: str,
    request: Request,
    caller: TraceCallerDep,
    resources: ResourcesDep,
    compress: Annotated[str, Header(alias="nnsight-compress")] = "False",
    nnsight_version: Annotated[str | None, Header(alias="nnsight-version")] = None,
) -> Response:
    """Queue the trace, wait for its job, and answer ``torch.save({"saves", "error"})``."""
    settings = resources.settings
    body = await request.body()
    if len(body) > settings.max_payload_bytes:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, payload_too_large(settings.max_payload_bytes))
    nnsight_request = NnsightRequest(
        nnsight_key=None,
        model_key=model_key,
        blob=body,
        compress=compress.lower() == "true",
        env={},
        versions=protocol.client_versions(nnsight_version, None),
        protocol="serve",
    )
    with refusals_as_http():
        job = await run_in_threadpool(submit_nnsight, resources, caller, nnsight_request)

    watcher: JobWatcher = request.app.state.job_watcher
    ended = None
    updates = follow(
        watcher, resources.sessions, job.id, orphan_grace_s=orphan_grace_s(settings), left=request.is_disconnected
    )
    async for seen in updates:
        if seen is not None and seen.job.status in ENDED:
            ended = seen.job
    if ended is None:
        return Response(status_code=499)  # the client left; its job was cancelled
    try:
        reply = await asyncio.to_thread(serve_reply, resources.store, ended.result_key, protocol.deferred_error(ended))
    except UnexpectedResult as error:
        raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"job {ended.id}'s result cannot be served: {error}") from None
    return StreamingResponse(read_chunks(reply), media_type="application/octet-stream")


@router.post("/{model_key:path}/v1/nnsight/register/{registration_id}", status_code=403)
@router.post("/{model_key:path}/v1/nnsight/register/{registration_id}/clear", status_code=403)
def register(model_key: str, registration_id: str) -> None:
    """Refused: edits for a whole engine (see the module's doc)."""
    raise HTTPException(status.HTTP_403_FORBIDDEN, REGISTER_REFUSED)
