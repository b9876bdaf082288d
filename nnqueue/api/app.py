"""The FastAPI application: :func:`create_app` wires settings, resources, limits and routers.

``uvicorn --factory nnqueue.api.app:create_app`` (what ``nnqueue serve-api`` runs) builds it from
the environment; tests pass their own :class:`~nnqueue.settings.Settings`. The schema must already
be migrated (``nnqueue db upgrade``): the API never changes it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from nnqueue.api import errors
from nnqueue.api.deps import RecentCallers, Resources
from nnqueue.api.job_watch import JobWatcher
from nnqueue.api.limits import BodySizeLimit
from nnqueue.api.routers import (
    domains,
    harvests,
    health,
    jobs,
    metrics,
    models,
    ndif,
    ndif_serve,
    schedules,
    steering,
)
from nnqueue.api.routers import status as status_page
from nnqueue.api.subscriptions import Subscriptions
from nnqueue.broker import create_celery_app
from nnqueue.db.session import make_engine, session_factory
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.settings import Settings
from nnqueue.storage import log_store, object_store_from_settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    resources = _resources(settings)
    log_store(settings, log)

    watcher = JobWatcher(resources.sessions, settings.worker_stale_after_s, always=settings.scale_to_zero_models)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        watcher.start()
        yield
        await watcher.stop()
        resources.engine.dispose()

    app = FastAPI(
        title="nnqueue",
        summary="Run NNsight interventions on persistent vLLM engines through a durable queue.",
        version="1",
        lifespan=lifespan,
    )
    app.state.resources = resources
    app.state.job_watcher = watcher
    app.state.subscriptions = Subscriptions(settings.ndif_subscriptions_per_key, settings.ndif_subscriptions_max)
    app.add_middleware(BodySizeLimit, max_payload_bytes=settings.max_payload_bytes)
    app.add_exception_handler(OperationalError, _broker_unreachable)
    app.add_exception_handler(PoolTimeout, _database_busy)
    errors.install(app)
    routers = (jobs.router, harvests.router, steering.router, schedules.router, models.router, domains.router)
    for router in (*routers, health.router, metrics.router, status_page.router, ndif.router, ndif_serve.router):
        app.include_router(router)
    return app


def _resources(settings: Settings) -> Resources:
    engine = make_engine(settings.resolved_database_url)
    return Resources(
        settings=settings,
        engine=engine,
        sessions=session_factory(engine),
        store=object_store_from_settings(settings),
        celery=create_celery_app(settings),
        admission=AdmissionPolicy.from_settings(settings, remember_live_models=True),
        callers=RecentCallers(settings.auth_cache_s),
    )


async def _database_busy(_request: Request, _error: Exception) -> JSONResponse:
    """Every pooled database connection stayed busy for the pool's timeout: overloaded, not broken."""
    detail = "the server is overloaded (no database connection came free in time); try again shortly"
    return JSONResponse(
        {"detail": detail}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "1"}
    )


async def _broker_unreachable(_request: Request, error: Exception) -> JSONResponse:
    """Enqueueing failed (the job was marked failed by ``submit_job``): a 503, not a bare 500."""
    detail = f"the broker is unreachable, so the job was not queued; try again later ({error})"
    return JSONResponse({"detail": detail}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
