"""``/v1/models``: the models that jobs can be submitted for, from live workers' heartbeats, and the trust domains
their engines serve now; their weights versions and checkpoint swaps (``/v1/models/{model_key}/weights``, :mod:`nnqueue.scheduler.weights`)."""

from __future__ import annotations

from collections import defaultdict

from fastapi import APIRouter, HTTPException, status

from nnqueue.api.deps import AdminCallerDep, CallerDep, SessionDep, SettingsDep
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import (
    ModelInfo,
    ModelsResponse,
    ModelWeightsResponse,
    WeightsUpdateRequest,
    WeightsUpdateView,
    WorkerWeights,
)
from nnqueue.enginecore.taps import served_taps
from nnqueue.scheduler.registry import live_workers
from nnqueue.scheduler.trust_domains import domain_of, shown
from nnqueue.scheduler.weights import WeightsRejected, check_source, request_update, updates_after

router = APIRouter(prefix="/v1/models", tags=["models"], route_class=ReleasingRoute)


@router.get("")
def list_models(caller: CallerDep, session: SessionDep, settings: SettingsDep) -> ModelsResponse:
    """Each model with a live worker (not stopped, heartbeat within NNQUEUE_WORKER_STALE_AFTER_S), the taps its
    tapped workers all serve (a job may run on any of its workers) and the trust domains their engines serve."""
    workers: dict[str, int] = defaultdict(int)
    capacity: dict[str, int] = defaultdict(int)
    engine: dict[str, str] = {}
    versions: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    taps: dict[str, set[str]] = {}
    domains: dict[str, set[str]] = defaultdict(set)
    yours = domain_of(session, caller.owner, settings.trust_domains)
    for worker in live_workers(session, settings.worker_stale_after_s):
        if worker.domain is not None:
            domains[worker.model_key].add(shown(worker.domain, yours, caller.is_admin))
        workers[worker.model_key] += 1
        capacity[worker.model_key] += worker.capacity
        engine[worker.model_key] = worker.engine  # one kind per model key (the registry refuses a second)
        if worker.weights_version is not None:
            versions[worker.model_key][worker.weights_version] += 1
        served = served_taps(worker.capture_points)
        if served is not None:
            key = worker.model_key
            taps[key] = taps[key] & set(served) if key in taps else set(served)
    return ModelsResponse(
        models=[
            ModelInfo(
                model_key=key,
                workers=workers[key],
                capacity=capacity[key],
                engine=engine[key],
                weights_versions=dict(versions[key]),
                taps=sorted(taps[key]) if key in taps else None,
                domains=sorted(domains[key]),
            )
            for key in sorted(workers)
        ]
    )


@router.get("/{model_key:path}/weights")
def model_weights(
    model_key: str, _caller: CallerDep, session: SessionDep, settings: SettingsDep
) -> ModelWeightsResponse:
    """The weights version each live worker of the model serves, and the model's checkpoint swaps, oldest first."""
    return _weights_view(session, model_key, settings.worker_stale_after_s)


@router.post(
    "/{model_key:path}/weights",
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        403: {"description": "The key lacks the admin scope."},
        404: {"description": "No live worker serves the model key."},
        409: {"description": "The model is served by a transformers engine."},
        422: {"description": "A source that is not s3://<the store's bucket>/<key> or an absolute path."},
    },
)
def update_weights(
    model_key: str, body: WeightsUpdateRequest, caller: AdminCallerDep, session: SessionDep, settings: SettingsDep
) -> ModelWeightsResponse:
    """Load a safetensors checkpoint (every tensor, or the named ones) into every live engine of the model,
    without restarting them. Each worker applies it at its next heartbeat, between requests (none runs across
    it), and then serves the update's version; follow it with ``GET`` on the same path."""
    bucket = settings.s3.bucket if settings.s3 is not None else None
    try:
        source = check_source(body.source, bucket)
        request_update(session, model_key, source, body.tensors, caller.owner, settings.worker_stale_after_s)
    except WeightsRejected as refused:
        raise HTTPException(refused.status, refused.reason) from None
    session.commit()
    return _weights_view(session, model_key, settings.worker_stale_after_s)


def _weights_view(session: SessionDep, model_key: str, stale_after_s: float) -> ModelWeightsResponse:
    workers = [worker for worker in live_workers(session, stale_after_s) if worker.model_key == model_key]
    return ModelWeightsResponse(
        model_key=model_key,
        workers=[
            WorkerWeights(
                worker_id=worker.id,
                version=worker.weights_version,
                since=worker.weights_since,
                source=worker.weights_source,
            )
            for worker in workers
        ],
        updates=[
            WeightsUpdateView(
                id=update.id,
                version=update.version,
                source=update.source,
                tensors=update.tensors,
                owner=update.owner,
                created_at=update.created_at,
            )
            for update in updates_after(session, model_key, 0)
        ],
    )
