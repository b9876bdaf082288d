"""``/v1/models``: the models that jobs can be submitted for, from live workers' heartbeats."""

from __future__ import annotations

from collections import defaultdict

from fastapi import APIRouter

from nnqueue.api.deps import CallerDep, SessionDep, SettingsDep
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import ModelInfo, ModelsResponse
from nnqueue.enginecore.taps import served_taps
from nnqueue.scheduler.registry import live_workers

router = APIRouter(prefix="/v1/models", tags=["models"], route_class=ReleasingRoute)


@router.get("")
def list_models(_caller: CallerDep, session: SessionDep, settings: SettingsDep) -> ModelsResponse:
    """Each model with a live worker (not stopped, heartbeat within NNQUEUE_WORKER_STALE_AFTER_S), and the taps
    its tapped workers all serve (a job may run on any of its workers)."""
    workers: dict[str, int] = defaultdict(int)
    capacity: dict[str, int] = defaultdict(int)
    engine: dict[str, str] = {}
    taps: dict[str, set[str]] = {}
    for worker in live_workers(session, settings.worker_stale_after_s):
        workers[worker.model_key] += 1
        capacity[worker.model_key] += worker.capacity
        engine[worker.model_key] = worker.engine  # one kind per model key (the registry refuses a second)
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
                taps=sorted(taps[key]) if key in taps else None,
            )
            for key in sorted(workers)
        ]
    )
