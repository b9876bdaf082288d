"""API tests: ``create_app`` on the suite's real Postgres, Redis and S3, called through FastAPI's TestClient.

Each module gets its own service namespace (a fresh migrated database, a Redis database number and an
S3 bucket): the worker tests' ``services`` fixture.
Jobs are submitted for models that "live" workers serve: real worker rows, registered and kept fresh
through :mod:`nnqueue.scheduler.registry`; only ``test_results.py`` starts a real worker process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.api import auth
from nnqueue.api.app import create_app
from nnqueue.api.deps import Resources
from nnqueue.db.session import transaction
from nnqueue.scheduler import registry
from nnqueue.settings import Settings
from tests.workers.conftest import Services, services, start_worker  # noqa: F401  (fixtures; start_worker for test_results)


class Api:
    """A TestClient on one app, with helpers that speak the API contract."""

    def __init__(self, http: TestClient) -> None:
        self.http = http
        self.resources: Resources = http.app.state.resources

    def new_key(self, owner: str) -> dict[str, str]:
        """Headers that authenticate as a fresh key of ``owner``."""
        return {"Authorization": f"Bearer {create_secret(self.resources.sessions, owner)}"}

    def submit(self, headers: dict[str, str], payload: bytes = b"trace", **spec: Any) -> httpx.Response:
        body = {"model_key": spec.pop("model_key", LIVE_MODEL), **spec}
        return self.http.post(
            "/v1/jobs", headers=headers, data={"spec": json.dumps(body)}, files={"payload": ("trace.bin", payload)}
        )

    def submit_ok(self, headers: dict[str, str], payload: bytes = b"trace", **spec: Any) -> dict[str, Any]:
        response = self.submit(headers, payload, **spec)
        assert response.status_code == 201, response.text
        return response.json()


LIVE_MODEL = "api-test-model"


def create_secret(sessions: sessionmaker[Session], owner: str) -> str:
    with transaction(sessions) as session:
        _, secret = auth.create_key(session, owner)
    return secret


def register_worker(sessions: sessionmaker[Session], model_key: str = LIVE_MODEL, capacity: int = 4) -> str:
    """A live worker row (its heartbeat is fresh until worker_stale_after_s passes)."""
    worker_id = registry.new_worker_id()
    registry.register(sessions, worker_id, model_key, f"queue-{model_key}", capacity)
    return worker_id


@contextmanager
def api_client(services: Services, **overrides: Any) -> Iterator[Api]:
    """An app on the module's services, with some settings overridden."""
    with app_client(Settings(_env_file=None, **{**services.settings.model_dump(), **overrides})) as api:
        yield api


@contextmanager
def app_client(settings: Settings) -> Iterator[Api]:
    with TestClient(create_app(settings)) as http:
        yield Api(http)


@pytest.fixture(scope="module")
def api(services: Services) -> Iterator[Api]:
    # Registered worker rows stay live for the whole module (tests of staleness make their own app).
    with api_client(services, worker_stale_after_s=3600) as client:
        yield client
