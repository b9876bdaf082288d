"""Where job payloads and results are kept: S3 (or compatible) in production, a local directory
for the embedded default. Use :func:`object_store_from_settings` to get the configured one."""

from __future__ import annotations

from nnqueue.settings import Settings
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore, PresignUnsupported
from nnqueue.storage.s3 import S3ObjectStore


def object_store_from_settings(settings: Settings) -> ObjectStore:
    """S3 when ``settings.s3`` is set, otherwise the local directory ``settings.resolved_store_dir``."""
    if settings.s3 is not None:
        return S3ObjectStore(settings.s3)
    return LocalObjectStore(settings.resolved_store_dir)


__all__ = [
    "LocalObjectStore",
    "ObjectNotFound",
    "ObjectStore",
    "PresignUnsupported",
    "S3ObjectStore",
    "object_store_from_settings",
]
