"""nnsight's own clients against a real nnqueue: the API under uvicorn (a thread of the test process) on the
suite's Postgres, Redis and S3, and real ``nnqueue worker`` processes for the tiny model, registered under the
key nnsight's clients send (the model's path). The clients are nnsight 0.8.1's, unmodified: only their
configuration (``CONFIG.API``: host, key, compression) is set, as users set it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from nnqueue.client import Client
from nnqueue.embedded import ApiServer
from nnqueue.settings import Settings
from tests.client.conftest import new_secret
from tests.utils.services import Services


@pytest.fixture(scope="module")
def api_server(services: Services) -> Iterator[ApiServer]:
    server = ApiServer(Settings(_env_file=None, **services.settings.model_dump()))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secret(services: Services) -> str:
    return new_secret(services, "alice")


@pytest.fixture(scope="module")
def client(api_server: ApiServer, secret: str) -> Iterator[Client]:
    with Client(api_server.url, secret) as client:
        yield client


@pytest.fixture
def ndif(monkeypatch: pytest.MonkeyPatch, api_server: ApiServer, secret: str) -> Any:
    """nnsight's CONFIG pointed at this nnqueue (what NDIF_HOST and NDIF_API_KEY set); returns CONFIG."""
    from nnsight import CONFIG

    monkeypatch.setattr(CONFIG.API, "HOST", f"{api_server.url}/ndif")
    monkeypatch.setattr(CONFIG.API, "APIKEY", secret)
    monkeypatch.setattr(CONFIG.API, "COMPRESS", True)
    monkeypatch.setattr(CONFIG.APP, "REMOTE_LOGGING", False)
    return CONFIG
