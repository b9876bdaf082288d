"""Session-wide fixtures for real backing servers: PostgreSQL, Redis and an S3-compatible store.

A server starts only when a test first asks for its fixture, and stops at the end of the session.
To test against servers you already run, set ``NNQUEUE_TEST_DATABASE_URL``, ``NNQUEUE_TEST_REDIS_URL``
or ``NNQUEUE_TEST_S3_ENDPOINT`` (with ``NNQUEUE_TEST_S3_ACCESS_KEY_ID``,
``NNQUEUE_TEST_S3_SECRET_ACCESS_KEY``, ``NNQUEUE_TEST_S3_REGION``, ``NNQUEUE_TEST_S3_BUCKET``); then
nothing is started. How the servers are started lives in ``tests/servers.py``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from nnsight.schema.request import RequestModel
from nnsight.tracing.backend import Backend
from pydantic import SecretStr
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from nnqueue.db import migrate
from nnqueue.settings import S3Settings
from nnqueue.workers.engine_host import EngineHost
from tests import servers

TEST_BUCKET = "nnqueue-test"
# Engine arguments for the tiny model, the same for in-process engines and worker processes.
TINY_ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 256, "seed": 0}
T = TypeVar("T")


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


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a locally trained tokenizer (see tests/tiny_model.py)."""
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


@dataclass
class InProcessEngine:
    """An engine in the test process, on its own loop (an ``EngineHost``, as in a worker)."""

    host: EngineHost
    model: Any

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.host.call(coroutine)


@pytest.fixture(scope="session")
def inprocess_engine(tiny_model_path: Path) -> Iterator[InProcessEngine]:
    """The tiny model on a dispatched async engine with nnqueue's worker class, shared by the session."""
    from nnqueue.engines.platform import load_engine

    async def load() -> Any:
        return load_engine(str(tiny_model_path), **TINY_ENGINE_KWARGS)

    host = EngineHost()
    engine = InProcessEngine(host, host.call(load()))
    yield engine
    engine.model.vllm_entrypoint.shutdown()
    # Drop it now: AsyncLLM.__del__ shuts down again, which fails at interpreter exit.
    engine.model.vllm_entrypoint = None
    host.stop()


class PayloadBackend(Backend):
    """Serialize the trace instead of running it, as a client does before submitting it."""

    payload: bytes

    def __call__(self, tracer: Any) -> None:
        self.payload = RequestModel.serialize(tracer)


PROMPTS = ["The Eiffel Tower is in", "A job queue runs many traces"]


def two_invoke_payload(client: Any) -> bytes:
    """One trace, an invoke per prompt of PROMPTS, saving layer 0's output (HF's hidden state) and the logits."""
    backend = PayloadBackend()
    with client.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        with tracer.invoke(PROMPTS[0]):
            out = client.model.layers[0].output
            h0 = (out[0] + out[1]).save()  # vLLM's Llama layer returns (mlp_out, residual)
            logits0 = client.logits.save()
        with tracer.invoke(PROMPTS[1]):
            out = client.model.layers[0].output
            h1 = (out[0] + out[1]).save()
            logits1 = client.logits.save()
    return backend.payload


@pytest.fixture(scope="session")
def client_model(tiny_model_path: Path) -> Any:
    """A meta model, as a CPU-only client writes traces against (stock nnsight class)."""
    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()
    return VLLM(str(tiny_model_path), **TINY_ENGINE_KWARGS)
