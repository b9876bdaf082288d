"""Client tests: the real API (uvicorn on a free port, in a thread) on the suite's Postgres, Redis and S3,
with one real ``nnqueue worker`` process for the tiny model (``start_worker``).

Each module gets its own service namespace (``services``: its own database, Redis database and bucket).
Results live in S3 (SeaweedFS, which checks signatures), so result downloads follow the API's redirect
to a presigned URL unless a test asks for ``inline``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from nnqueue.api import auth
from nnqueue.client import Client
from nnqueue.db.session import transaction
from nnqueue.embedded import ApiServer
from nnqueue.settings import Settings
from tests.utils.services import Services, WorkerProcess


@pytest.fixture(scope="module")
def api_server(services: Services) -> Iterator[ApiServer]:
    server = ApiServer(Settings(_env_file=None, **services.settings.model_dump()))
    yield server
    server.stop()


def new_secret(services: Services, owner: str) -> str:
    with transaction(services.sessions) as session:
        _, secret = auth.create_key(session, owner, ["trace"])
    return secret


@pytest.fixture(scope="module")
def secret(services: Services) -> str:
    return new_secret(services, "alice")


@pytest.fixture(scope="module")
def client(api_server: ApiServer, secret: str) -> Iterator[Client]:
    with Client(api_server.url, secret) as client:
        yield client


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return start_worker(max_concurrent_jobs=4)
