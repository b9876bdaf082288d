"""Where job payloads and results are kept: S3 (or compatible) in production, a local directory
for the embedded default. Use :func:`object_store_from_settings` to get the configured one, and
:func:`describe_store` / :func:`unshared_store_problem` to say which one it is and whether it is wrong."""

from __future__ import annotations

import logging

from sqlalchemy.engine import make_url

from nnqueue.settings import Settings
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore, PresignUnsupported, StoreNotShared
from nnqueue.storage.s3 import S3ObjectStore


def object_store_from_settings(settings: Settings) -> ObjectStore:
    """S3 when ``settings.s3`` is set (any ``NNQUEUE_S3__*``), otherwise the local directory ``settings.store_dir``."""
    if settings.s3 is not None:
        return S3ObjectStore(settings.s3)
    return LocalObjectStore(settings.resolved_store_dir)


def describe_store(settings: Settings) -> str:
    """The store these settings choose, for logs and ``/readyz``: ``s3://bucket at endpoint`` or ``local folder``."""
    if settings.s3 is not None:
        where = settings.s3.endpoint_url or f"AWS S3 ({settings.s3.region})"
        return f"s3://{settings.s3.bucket} at {where}"
    return f"local folder {settings.resolved_store_dir}"


def unshared_store_problem(settings: Settings) -> str | None:
    """Why this process's store is probably not the one the other processes use, or None.

    A local folder is per host. With the embedded SQLite database every process runs on this host and
    shares it; with a server database (Postgres) the API and the workers may run on different hosts, and
    each would keep payloads and results in its own folder: a worker could not read a payload the API
    stored, and the API could not serve a worker's result. That deployment needs S3 (``NNQUEUE_S3__*``),
    or ``NNQUEUE_STORE_DIR`` set to a folder that every process mounts (the explicit choice is trusted).
    """
    if settings.s3 is not None or not settings.store_dir_defaulted:
        return None
    if make_url(settings.resolved_database_url).get_backend_name() == "sqlite":
        return None
    return (
        f"the object store is the default local folder {settings.resolved_store_dir}, but the database is a "
        "server that processes on other hosts share: set NNQUEUE_S3__* (an S3 store), or NNQUEUE_STORE_DIR to "
        "a folder that the API and every worker mount"
    )


def log_store(settings: Settings, log: logging.Logger) -> None:
    """Say at a process's start which store it uses, and warn loudly when it is probably not shared."""
    log.info("object store: %s", describe_store(settings))
    if problem := unshared_store_problem(settings):
        log.warning("%s", problem)


__all__ = [
    "LocalObjectStore",
    "ObjectNotFound",
    "ObjectStore",
    "PresignUnsupported",
    "S3ObjectStore",
    "StoreNotShared",
    "describe_store",
    "log_store",
    "object_store_from_settings",
    "unshared_store_problem",
]
