"""Session-wide fixtures for real backing servers: PostgreSQL, Redis and an S3-compatible store.

A server starts only when a test first asks for its fixture, and stops at the end of the session.
To test against servers you already run, set ``NNQUEUE_TEST_DATABASE_URL``, ``NNQUEUE_TEST_REDIS_URL``
or ``NNQUEUE_TEST_S3_ENDPOINT`` (with ``NNQUEUE_TEST_S3_ACCESS_KEY_ID``,
``NNQUEUE_TEST_S3_SECRET_ACCESS_KEY``, ``NNQUEUE_TEST_S3_REGION``, ``NNQUEUE_TEST_S3_BUCKET``); then
nothing is started. How the servers are started lives in ``tests/utils/servers.py``.

Also here, so that every test directory finds them: the tiny model (in-process engine and client meta
model), per-module service namespaces (``services``) with real ``nnqueue worker`` processes
(``start_worker``), and the real API under uvicorn with a key and a client (``api_server``, ``secret``, ``client``). Helpers are in ``tests/utils/``.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import SecretStr

from nnqueue.settings import S3Settings, Settings
from tests.utils import servers
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

# Only what each fixture needs, imported when it runs: every pytest process imports this file before its first
# test, and the engine, nnsight and the API would cost it about 25 s (collection <= 10 s: docs/development.md).
if TYPE_CHECKING:
    from nnqueue.client import Client
    from nnqueue.embedded import ApiServer
    from tests.utils.engines import InProcessEngine
    from tests.utils.services import Services, WorkerProcess

TEST_BUCKET = "nnqueue-test"


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    """A CLI command run in-process (``worker``, ``beat``) points the root logger at that run's stderr, which
    closes with it; later records in this process would then fail ("--- Logging error ---" in another CLI
    run's output). Each test gets back the root logger it began with."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """SQLAlchemy URL (``postgresql+psycopg://...``) of an empty database."""
    if url := os.environ.get("NNQUEUE_TEST_DATABASE_URL"):
        yield url
        return
    server = servers.start_postgres()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """``redis://127.0.0.1:<port>/0``."""
    if url := os.environ.get("NNQUEUE_TEST_REDIS_URL"):
        yield url
        return
    server = servers.start_redis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_settings() -> Iterator[S3Settings]:
    """Settings for an S3 endpoint that requires SigV4-signed requests. The bucket may not exist yet."""
    if endpoint := os.environ.get("NNQUEUE_TEST_S3_ENDPOINT"):
        secret = os.environ.get("NNQUEUE_TEST_S3_SECRET_ACCESS_KEY")
        yield S3Settings(
            endpoint_url=endpoint,
            bucket=os.environ.get("NNQUEUE_TEST_S3_BUCKET", TEST_BUCKET),
            region=os.environ.get("NNQUEUE_TEST_S3_REGION", "us-east-1"),
            access_key_id=os.environ.get("NNQUEUE_TEST_S3_ACCESS_KEY_ID"),
            secret_access_key=SecretStr(secret) if secret else None,
        )
        return
    server = servers.start_s3()
    try:
        yield S3Settings(
            endpoint_url=server.endpoint_url,
            bucket=TEST_BUCKET,
            region=server.region,
            access_key_id=server.access_key_id,
            secret_access_key=SecretStr(server.secret_access_key),
        )
    finally:
        server.stop()


@pytest.fixture(scope="session")
def database_factory(postgres_url: str) -> Iterator[Callable[..., str]]:
    """Makes fresh databases on the suite's Postgres server, migrated to head; drops them at the end."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from nnqueue.db import migrate

    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    names: list[str] = []

    def create(migrated: bool = True) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        names.append(name)
        url = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
        if migrated:
            migrate.upgrade(url)
        return url

    yield create
    with admin.connect() as connection:
        for name in names:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def any_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database migrated to head: once on the suite's Postgres, once an embedded SQLite file."""
    from nnqueue.db import migrate

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'nnqueue.db'}"
        migrate.upgrade(url)
        return url
    return str(request.getfixturevalue("database_factory")())


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a locally trained tokenizer (see tests/utils/tiny_model.py)."""
    from tests.utils.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="session")
def inprocess_engine(tiny_model_path: Path) -> Iterator[InProcessEngine]:
    """The tiny model on a dispatched async engine with nnqueue's worker class, shared by the session."""
    from tests.utils.engines import running_engine

    with running_engine(tiny_model_path, **TINY_ENGINE_KWARGS) as engine:
        yield engine


@pytest.fixture(scope="session")
def client_model(tiny_model_path: Path) -> Any:
    """A meta model, as a CPU-only client writes traces against (stock nnsight class)."""
    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()
    return VLLM(str(tiny_model_path), **TINY_ENGINE_KWARGS)


@pytest.fixture(scope="module")
def services(database_factory: Callable[[], str], redis_url: str, s3_settings: S3Settings) -> Services:
    """The module's own service namespace: a fresh migrated database, a Redis database number, an S3 bucket."""
    from tests.utils.services import Services

    redis = servers.redis_database_url(redis_url)
    s3 = s3_settings.model_copy(update={"bucket": f"nnqueue-{uuid.uuid4().hex[:8]}"})
    return Services(database_factory(), redis, s3)


@pytest.fixture(scope="module")
def api_server(services: Services) -> Iterator[ApiServer]:
    """The HTTP API under uvicorn, in a thread of the test process, on the module's services."""
    from nnqueue.embedded import ApiServer

    server = ApiServer(Settings(_env_file=None, **services.settings.model_dump()))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secret(services: Services) -> str:
    """A key of alice's on the module's services."""
    from tests.utils.api import create_secret

    return create_secret(services.sessions, "alice")


@pytest.fixture(scope="module")
def client(api_server: ApiServer, secret: str) -> Iterator[Client]:
    """The nnqueue client on ``api_server`` with alice's key."""
    from nnqueue.client import Client

    with Client(api_server.url, secret) as client:
        yield client


@pytest.fixture(scope="module")
def start_worker(
    services: Services, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., WorkerProcess]]:
    """Starts ``nnqueue worker`` processes for the tiny model on the module's services; stops them at the end."""
    from tests.utils.services import WorkerProcess

    started: list[WorkerProcess] = []
    logs = tmp_path_factory.mktemp("worker-logs")

    def start(model_path: Path = tiny_model_path, **kwargs: Any) -> WorkerProcess:
        """``kwargs``: WorkerProcess's (max_concurrent_jobs, model_key, engine, env, cwd, user)."""
        worker = WorkerProcess(services, model_path, logs / f"worker-{len(started)}.log", **kwargs)
        started.append(worker)
        worker.wait_registered()
        return worker

    yield start
    for worker in started:
        worker.stop()
