"""The FastAPI application: :func:`create_app` wires settings, resources, limits and routers.

``uvicorn --factory nnqueue.api.app:create_app`` (what ``nnqueue serve-api`` runs) builds it from
the environment; tests pass their own :class:`~nnqueue.settings.Settings`. The schema must already
be migrated (``nnqueue db upgrade``): the API never changes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nnqueue.api.deps import Resources
from nnqueue.api.routers import health, jobs, models
from nnqueue.db.session import make_engine, session_factory
from nnqueue.settings import Settings
from nnqueue.storage import object_store_from_settings
from nnqueue.workers.celery_app import create_celery_app

# Room in a request body for the multipart framing and the spec field (which Starlette caps at 1 MiB).
FORM_OVERHEAD_BYTES = 2 * 1024 * 1024


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    resources = _resources(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        resources.engine.dispose()

    app = FastAPI(
        title="nnqueue",
        summary="Run NNsight interventions on persistent vLLM engines through a durable queue.",
        version="1",
        lifespan=lifespan,
    )
    app.state.resources = resources
    app.add_middleware(BodySizeLimit, max_payload_bytes=settings.max_payload_bytes)
    app.add_exception_handler(OperationalError, _broker_unreachable)
    for router in (jobs.router, models.router, health.router):
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
    )


async def _broker_unreachable(_request: Request, error: Exception) -> JSONResponse:
    """Enqueueing failed (the job was marked failed by ``submit_job``): a 503, not a bare 500."""
    detail = f"the broker is unreachable, so the job was not queued; try again later ({error})"
    return JSONResponse({"detail": detail}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)


class BodySizeLimit:
    """Refuses request bodies that cannot fit a payload of ``max_payload_bytes`` with 413: at once
    when Content-Length says so, otherwise as soon as too many bytes have streamed in, so an upload
    is never buffered or spooled to disk far past the limit."""

    def __init__(self, app: ASGIApp, max_payload_bytes: int) -> None:
        self.app, self.max_payload_bytes = app, max_payload_bytes
        self.max_bytes = max_payload_bytes + FORM_OVERHEAD_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await JSONResponse({"detail": self._detail()}, status.HTTP_413_CONTENT_TOO_LARGE)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # Raised inside the route's body parsing; FastAPI passes HTTPExceptions through.
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, self._detail())
            return message

        await self.app(scope, limited_receive, send)

    def _detail(self) -> str:
        return payload_too_large(self.max_payload_bytes)


def payload_too_large(limit: int) -> str:
    return f"payload too large: the limit is {limit} bytes (NNQUEUE_MAX_PAYLOAD_BYTES)"
