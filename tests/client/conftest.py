"""Client tests: the real API (uvicorn on a free port, in a thread) on the suite's Postgres, Redis and S3,
with one real ``nnqueue worker`` process for the tiny model (the worker tests' ``start_worker``).

The module's Redis database is 15: the worker tests count theirs up from 1 and the API tests from 8.
Results live in S3 (SeaweedFS, which checks signatures), so result downloads follow the API's redirect
to a presigned URL unless a test asks for ``inline``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from nnqueue.api import auth
from nnqueue.client import Client
from nnqueue.db.session import transaction
from nnqueue.embedded import ApiServer
from nnqueue.settings import S3Settings, Settings
from tests.workers.conftest import Services, WorkerProcess, start_worker  # noqa: F401  (start_worker: a fixture)

REDIS_DATABASE = 15


@pytest.fixture(scope="module")
def services(database_factory: Callable[[], str], redis_url: str, s3_settings: S3Settings) -> Services:
    redis = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DATABASE}"
    s3 = s3_settings.model_copy(update={"bucket": f"nnqueue-{uuid.uuid4().hex[:8]}"})
    return Services(database_factory(), redis, s3)


@pytest.fixture(scope="module")
def api_server(services: Services) -> Iterator[ApiServer]:
    server = ApiServer(Settings(_env_file=None, **services.settings.model_dump()))
    yield server
    server.stop()


def new_secret(services: Services, owner: str) -> str:
    with transaction(services.sessions) as session:
        _, secret = auth.create_key(session, owner)
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
