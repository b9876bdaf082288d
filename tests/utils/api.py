"""Calling the API in tests: ``create_app`` on a module's services through FastAPI's TestClient, keys, and
worker rows that make a model "live" without a worker process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.api import auth
from nnqueue.api.app import create_app
from nnqueue.api.deps import Resources
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler import registry
from nnqueue.settings import Settings
from tests.utils.results import result_fields, store_result
from tests.utils.servers import free_ports
from tests.utils.services import Services


class Api:
    """A TestClient on one app, with helpers that speak the API contract."""

    def __init__(self, http: TestClient) -> None:
        self.http = http
        self.resources: Resources = http.app.state.resources

    def new_key(self, owner: str, scopes: tuple[str, ...] = ("trace",)) -> dict[str, str]:
        """Headers that authenticate as a fresh key of ``owner`` (a trace key unless ``scopes`` say otherwise)."""
        return {"Authorization": f"Bearer {create_secret(self.resources.sessions, owner, scopes)}"}

    def submit(self, headers: dict[str, str], payload: bytes | None = None, **spec: Any) -> httpx.Response:
        from tests.utils.payloads import fake_trace  # payloads imports nnsight (torch): not for every API test

        body = {"model_key": spec.pop("model_key", LIVE_MODEL), **spec}
        files = {"payload": ("trace.bin", fake_trace() if payload is None else payload)}
        return self.http.post("/v1/jobs", headers=headers, data={"spec": json.dumps(body)}, files=files)

    def submit_raw(
        self, headers: dict[str, str], payload: bytes | None = None, spec_header: str | bytes | None = None, **spec: Any
    ) -> httpx.Response:
        """``POST /v1/jobs`` as the Python client sends it: the payload as the body, the spec in its header
        (``spec_header`` verbatim when given)."""
        from tests.utils.payloads import fake_trace

        if spec_header is None:
            spec_header = json.dumps({"model_key": spec.pop("model_key", LIVE_MODEL), **spec})
        raw = {**headers, "Content-Type": "application/octet-stream", "Nnqueue-Spec": spec_header}
        return self.http.post("/v1/jobs", headers=raw, content=fake_trace() if payload is None else payload)

    def submit_ok(self, headers: dict[str, str], payload: bytes | None = None, **spec: Any) -> dict[str, Any]:
        response = self.submit(headers, payload, **spec)
        assert response.status_code == 201, response.text
        return response.json()


LIVE_MODEL = "api-test-model"
HARVEST_MODEL = "harvest-model"
# What a vLLM worker of a two-layer Llama publishes as capturable (a part of nnqueue.enginecore.capture_points' list).
CAPTURE_POINTS = [
    {"module": "model.embed_tokens", "io": "output", "parts": []},
    {"module": "model.layers.0", "io": "output", "parts": ["residual_stream", "hidden", "residual"]},
    {"module": "model.layers.1", "io": "output", "parts": ["residual_stream", "hidden", "residual"]},
]


def create_secret(sessions: sessionmaker[Session], owner: str, scopes: tuple[str, ...] = ("trace",)) -> str:
    with transaction(sessions) as session:
        _, secret = auth.create_key(session, owner, scopes)
    return secret


def register_worker(
    sessions: sessionmaker[Session],
    model_key: str = LIVE_MODEL,
    capacity: int = 4,
    capture_points: list[dict[str, Any]] | None = None,
    weights: tuple[str, dict[str, Any]] | None = None,
) -> str:
    """A live worker row (its heartbeat is fresh until worker_stale_after_s passes); with ``capture_points``,
    one that runs harvests; ``weights``: the version it serves and its source."""
    worker_id = registry.new_worker_id()
    registry.register(
        sessions, worker_id, model_key, f"queue-{model_key}", capacity, capture_points=capture_points, weights=weights
    )
    return worker_id


def submit_harvest(
    http: Any, headers: dict[str, str], spec: dict[str, Any], upload: tuple[str, bytes] | None = None
) -> httpx.Response:
    """``POST /v1/harvests`` through ``http`` (a TestClient, or an httpx client on a served API)."""
    files = {"dataset": upload} if upload else None
    return http.post("/v1/harvests", headers=headers, data={"spec": json.dumps(spec)}, files=files)


@contextmanager
def api_client(services: Services, **overrides: Any) -> Iterator[Api]:
    """An app on the module's services, with some settings overridden."""
    with app_client(Settings(_env_file=None, **{**services.settings.model_dump(), **overrides})) as api:
        yield api


@contextmanager
def app_client(settings: Settings) -> Iterator[Api]:
    with TestClient(create_app(settings)) as http:
        yield Api(http)


@contextmanager
def served(settings: Settings) -> Iterator[str]:
    """The app on a real port (uvicorn in a thread), as browsers and concurrent clients reach it; yields its URL."""
    [port] = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def api_command(argv: list[str], env: dict[str, str], port: int, timeout: float = 90) -> Iterator[str]:
    """``python -m nnqueue <argv>`` (an API serving on ``port``) in a process group of its own, until it answers
    ``/healthz``; yields its URL and stops the group afterwards."""
    process = subprocess.Popen(
        [sys.executable, "-m", "nnqueue", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            try:
                httpx.get(f"{url}/healthz")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, f"nnqueue {' '.join(argv)} did not answer in {timeout:g} s"
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def complete(services: Services, job_id: uuid.UUID | str, saves: dict[str, Any], **fields: Any) -> None:
    """Run a job to COMPLETED the way a worker does: claim, store the result, finish (with ``fields``)."""
    job_uuid = uuid.UUID(str(job_id))
    with transaction(services.sessions) as session:
        transition(session, job_uuid, JobStatus.RUNNING, worker_id="test-worker")
    stored = store_result(services.store, job_uuid, saves)
    with transaction(services.sessions) as session:
        transition(
            session,
            job_uuid,
            JobStatus.COMPLETED,
            **{**result_fields(stored), "progress_done": 1, **fields},
        )
