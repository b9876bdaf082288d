"""``/v1/models``: the models that jobs can be submitted for, from live workers' heartbeats."""

from __future__ import annotations

from collections import defaultdict

from fastapi import APIRouter

from nnqueue.api.deps import CallerDep, SessionDep, SettingsDep
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import ModelInfo, ModelsResponse
from nnqueue.scheduler.registry import live_workers

router = APIRouter(prefix="/v1/models", tags=["models"], route_class=ReleasingRoute)


@router.get("")
def list_models(_caller: CallerDep, session: SessionDep, settings: SettingsDep) -> ModelsResponse:
    """Each model with a live worker (not stopped, heartbeat within NNQUEUE_WORKER_STALE_AFTER_S)."""
    workers: dict[str, int] = defaultdict(int)
    capacity: dict[str, int] = defaultdict(int)
    engine: dict[str, str] = {}
    for worker in live_workers(session, settings.worker_stale_after_s):
        workers[worker.model_key] += 1
        capacity[worker.model_key] += worker.capacity
        engine[worker.model_key] = worker.engine  # one kind per model key (the registry refuses a second)
    return ModelsResponse(
        models=[
            ModelInfo(model_key=key, workers=workers[key], capacity=capacity[key], engine=engine[key])
            for key in sorted(workers)
        ]
    )
