"""``nnqueue serve-api``: refuses a database that is not migrated, else serves the app with uvicorn."""

from __future__ import annotations

import os
from collections.abc import Callable

import httpx
import pytest
from typer.testing import CliRunner

from nnqueue.cli import app
from tests.utils.api import api_command
from tests.utils.servers import free_ports
from tests.utils.services import Services


def test_serve_api_refuses_an_unmigrated_database(
    database_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", database_factory(migrated=False))
    monkeypatch.setenv("NNQUEUE_BROKER_URL", "redis://127.0.0.1:1/0")  # set: the schema is what it refuses
    result = CliRunner().invoke(app, ["serve-api"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert "none (no nnqueue tables)" in result.output and "run `nnqueue db upgrade`" in result.output


def test_serve_api_serves_the_app(services: Services) -> None:
    [port] = free_ports(1)
    with api_command(["serve-api", "--port", str(port)], {**os.environ, **services.env}, port) as url:
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{url}/readyz").status_code == 200
        schema = httpx.get(f"{url}/openapi.json").json()
        assert {"/v1/jobs", "/v1/jobs/{job_id}/result", "/v1/models", "/readyz"} <= set(schema["paths"])
        assert httpx.get(f"{url}/v1/jobs").status_code == 401
