"""``/healthz`` (the process answers) and ``/readyz`` (it can reach everything a job needs).

Neither needs a key: load balancers and orchestrators call them. Readiness checks the database
(``SELECT 1``), the broker (a connection through the Celery app, so any transport works) and the
object store (a lookup of a key that need not exist), and names the ones that failed. It also names the
store in use; a default local folder while the database is a shared server is not ready (see
:func:`nnqueue.storage.unshared_store_problem`): the workers would keep results the API cannot serve. And it
says, per live worker, what its engine processes run under (the engine user, or root kept, and why; the
seccomp filter, network and filesystem), as the worker registered it (:mod:`nnqueue.isolation`), and sums it
up in ``isolation``: ``degraded`` when any live worker's engine is not fully isolated (such a worker runs only
its operator's traces). Degraded isolation is visible, not unready: the service still answers 200.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Response, status
from sqlalchemy import text

from nnqueue.api.deps import Resources, get_resources
from nnqueue.api.schemas import HealthResponse, IsolationSummary, ReadyResponse
from nnqueue.scheduler import registry
from nnqueue.storage import StoreNotShared, describe_store, unshared_store_problem

router = APIRouter(tags=["health"])
BROKER_TIMEOUT_S = 5.0
PROBE_KEY = "readyz/probe"


@router.get("/healthz")
def healthz() -> HealthResponse:
    return HealthResponse()


@router.get("/readyz", responses={503: {"model": ReadyResponse, "description": "Something is unreachable."}})
def readyz(resources: Annotated[Resources, Depends(get_resources)], response: Response) -> ReadyResponse:
    checks = {name: _outcome(check, resources) for name, check in CHECKS.items()}
    store = describe_store(resources.settings)
    engines = _engines(resources) if checks["database"] == "ok" else {}
    isolation = _isolation(engines)
    if all(result == "ok" for result in checks.values()):
        return ReadyResponse(status="ready", checks=checks, store=store, engines=engines, isolation=isolation)
    response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return ReadyResponse(status="unavailable", checks=checks, store=store, engines=engines, isolation=isolation)


def _engines(resources: Resources) -> dict[str, dict[str, str]]:
    """What each live worker's engine processes run under, as the worker registered it (nnqueue.isolation)."""
    with resources.sessions() as session:
        workers = registry.live_workers(session, resources.settings.worker_stale_after_s)
    return {worker.id: worker.containment for worker in workers if worker.containment}


def _isolation(engines: dict[str, dict[str, str]]) -> IsolationSummary:
    """``full`` when every live worker registered a fully isolated engine; ``degraded`` when any did not (or
    registered before the isolation was summed up)."""
    if not engines:
        return "no live worker"
    return "full" if all(engine.get("isolation") == "full" for engine in engines.values()) else "degraded"


def _database(resources: Resources) -> None:
    with resources.engine.connect() as connection:
        connection.execute(text("SELECT 1"))


def _broker(resources: Resources) -> None:
    with resources.celery.connection_for_write() as connection:
        connection.ensure_connection(max_retries=0, timeout=BROKER_TIMEOUT_S)


def _object_store(resources: Resources) -> None:
    if problem := unshared_store_problem(resources.settings):
        raise StoreNotShared(problem)
    resources.store.exists(PROBE_KEY)


CHECKS: dict[str, Callable[[Resources], None]] = {
    "database": _database,
    "broker": _broker,
    "object_store": _object_store,
}


def _outcome(check: Callable[[Resources], None], resources: Resources) -> str:
    try:
        check(resources)
    except Exception as error:  # noqa: BLE001 - any failure means "not ready"; report it rather than raise
        return f"{type(error).__name__}: {error}"
    return "ok"
