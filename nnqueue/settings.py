"""Settings for every nnqueue process, read from the environment (``NNQUEUE_*``) and an optional ``.env``.

With nothing set, nnqueue runs on the *embedded default*: a SQLite file and a local object-store
directory under ``NNQUEUE_DATA_DIR`` (default ``./.nnqueue``). Production points the same settings at
Postgres, Redis and an S3-compatible store. Nested values use ``__``: ``NNQUEUE_S3__ENDPOINT_URL``.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class S3Settings(BaseModel):
    """An S3-compatible object store. Credentials may also come from boto3's usual chain when unset."""

    endpoint_url: str | None = None
    bucket: str = "nnqueue"
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NNQUEUE_", env_nested_delimiter="__", env_file=".env", extra="ignore")

    data_dir: Path = Path(".nnqueue")
    # SQLAlchemy URL; Postgres in production (postgresql+psycopg://...), SQLite for the embedded default.
    database_url: str | None = None
    # Celery broker URL (redis://...).
    broker_url: str | None = None
    # The object store: S3 when ``s3.endpoint_url`` or ``s3.bucket`` credentials are configured,
    # otherwise ``store_dir`` (default ``<data_dir>/objects``).
    s3: S3Settings | None = None
    store_dir: Path | None = None

    # Workers. A job's task message stays unacknowledged while it runs; Redis hands it to another
    # worker once this long has passed, so it must exceed the longest job timeout.
    broker_visibility_timeout_s: float = 7200.0
    worker_heartbeat_s: float = 5.0
    # A worker silent for this long is taken for dead: its RUNNING jobs may be taken over.
    worker_stale_after_s: float = 30.0
    default_job_timeout_s: float = 600.0
    # Intervention code that runs this long without handing control back to the model (a user's
    # endless loop) is stopped inside the engine, so that the jobs batched with it go on.
    engine_stall_timeout_s: float = 60.0

    # The HTTP API (``nnqueue serve-api``).
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # The largest serialized trace a client may submit, in bytes (larger uploads get 413).
    max_payload_bytes: int = 64 * 1024 * 1024
    # Jobs one API key may have queued or running at once (more submissions get 429).
    max_jobs_in_flight_per_key: int = 64
    # How long the presigned result URLs that the API redirects to stay valid.
    result_url_expiry_s: int = 3600

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'nnqueue.db').resolve()}"

    @cached_property
    def resolved_store_dir(self) -> Path:
        return (self.store_dir or self.data_dir / "objects").resolve()
