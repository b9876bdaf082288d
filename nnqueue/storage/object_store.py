"""The object-store interface that payloads and results go through, whatever the backend.

Two backends implement it with the same observable behaviour: :class:`~nnqueue.storage.s3.S3ObjectStore`
for production and :class:`~nnqueue.storage.local.LocalObjectStore` for the embedded default.

Conventions shared by every backend:

* Keys are ``/``-separated relative paths (see :func:`validate_key`); invalid keys raise ``ValueError``.
* Writes replace the whole object atomically: a reader sees the old object or the new one, never a
  partial one, and a write that fails leaves the previous state.
* Byte ranges are half-open like Python slices: ``get_bytes(key, start, end)`` returns bytes
  ``start`` up to but excluding ``end``; ``end`` past the object's end is clamped, and a ``start``
  at or past it gives ``b""``.
"""

from __future__ import annotations

import os
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import BinaryIO, Protocol, Self

from nnqueue.errors import NNqueueError

MAX_KEY_LENGTH = 1024  # S3's limit, in UTF-8 bytes


class ObjectStoreError(NNqueueError):
    """Base class of object-store errors."""


class ObjectNotFound(ObjectStoreError):
    """No object is stored under the key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object at key {key!r}")
        self.key = key


class PresignUnsupported(ObjectStoreError):
    """The backend cannot hand out URLs; serve the object through the API instead."""


class StoreNotShared(ObjectStoreError):
    """This process's store is a per-host folder while other processes may run elsewhere (see
    :func:`nnqueue.storage.unshared_store_problem`)."""


class ObjectReader(Protocol):
    """A readable binary stream over one object; close it (or use ``with``) when done.

    Read it in chunks with ``read(size)``; iterating it is not guaranteed to yield fixed chunks."""

    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> object: ...


class ObjectStore(ABC):
    """Whole objects under string keys."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key``, replacing any object there; returns the size in bytes."""

    @abstractmethod
    def put_stream(self, key: str, fileobj: BinaryIO, size_hint: int | None = None) -> int:
        """Store everything read from ``fileobj`` (until EOF) under ``key`` without holding it all in
        memory; returns the size in bytes. ``size_hint``, the expected size if known, lets a backend
        pick its part size."""

    def put_file(self, key: str, path: str) -> int:
        """Store the file at ``path`` under ``key`` and remove the file; returns the size in bytes.

        For a file another process wrote (an engine's result handed off to the worker). A backend may
        move it rather than copy it."""
        with open(path, "rb") as file:
            size = self.put_stream(key, file, size_hint=os.fstat(file.fileno()).st_size)
        os.unlink(path)
        return size

    @abstractmethod
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or the half-open range ``[start, end)`` of them."""

    @abstractmethod
    def open_stream(self, key: str) -> ObjectReader:
        """A stream of the object's bytes for downloads too large to hold in memory."""

    @abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; removing a missing object is not an error."""

    @abstractmethod
    def list_keys(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix`` (a plain string prefix, as S3's), in sorted order."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under the folder ``prefix`` (it ends with ``/``), found by one listing; how many.

        For retention: a job's results are whatever its attempts left under ``results/<job>/``, so one LIST
        finds them all, where deleting each possible key would cost a request per attempt and name.
        """
        keys = self.list_keys(_folder(prefix))
        self.delete_keys(keys)
        return len(keys)

    def delete_keys(self, keys: list[str]) -> None:
        """Remove these objects (missing ones are not an error)."""
        for key in keys:
            self.delete(key)

    @abstractmethod
    def presigned_get_url(self, key: str, expires_in: int) -> str:
        """A URL that lets anyone holding it GET the object for ``expires_in`` seconds.

        Raises :class:`PresignUnsupported` where the backend has no URLs of its own."""

    @abstractmethod
    def presigned_put_url(self, key: str, expires_in: int) -> str:
        """A URL that lets anyone holding it PUT (create or replace) the object for ``expires_in`` seconds.

        Raises :class:`PresignUnsupported` where the backend has no URLs of its own."""

    @abstractmethod
    def presigned_multipart(self, key: str, parts: int, expires_in: int) -> MultipartUpload:
        """Start a multipart upload of ``key`` and presign PUT URLs for its first ``parts`` parts: whoever holds
        them uploads the parts, then :meth:`complete_multipart` (or :meth:`abort_multipart`) ends the upload.

        Raises :class:`PresignUnsupported` where the backend has no URLs of its own."""

    @abstractmethod
    def complete_multipart(self, upload: MultipartUpload, etags: list[str]) -> int:
        """Assemble the upload from its parts 1..len(``etags``) (their ETags, in order); returns the size."""

    @abstractmethod
    def abort_multipart(self, upload: MultipartUpload) -> None:
        """Drop the upload and the parts uploaded so far; aborting a finished or unknown upload is not an error."""


@dataclass(frozen=True)
class MultipartUpload:
    """A multipart upload in progress: ``urls[i]`` takes part ``i + 1``."""

    key: str
    upload_id: str
    urls: list[str]


def _folder(prefix: str) -> str:
    """A prefix that names a folder: never empty (the whole store) and ending with ``/`` (not a sibling's start)."""
    if not prefix.endswith("/") or not prefix.strip("/"):
        raise ValueError(f"invalid folder prefix {prefix!r}: must be non-empty and end with '/'")
    return prefix


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key: non-empty ``/``-separated segments, none empty,
    ``.`` or ``..``, no backslash or NUL, at most 1024 UTF-8 bytes. Raises ``ValueError`` otherwise."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid object key {key!r}: must be a non-empty string")
    if len(key.encode()) > MAX_KEY_LENGTH:
        raise ValueError(f"invalid object key {key[:40]!r}...: longer than {MAX_KEY_LENGTH} bytes")
    if "\\" in key or "\x00" in key:
        raise ValueError(f"invalid object key {key!r}: contains a backslash or NUL")
    if any(segment in ("", ".", "..") for segment in key.split("/")):
        raise ValueError(f"invalid object key {key!r}: empty, '.' or '..' path segment (or a leading '/')")
    return key


def validate_range(start: int | None, end: int | None) -> tuple[int, int | None]:
    """Normalize ``get_bytes`` range arguments to ``(start, end)`` with ``start >= 0``."""
    start = 0 if start is None else start
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"invalid byte range [{start}, {end}): need 0 <= start <= end")
    return start, end


def validate_expiry(expires_in: int) -> int:
    """Presigned URLs live between one second and SigV4's maximum of seven days."""
    if not 1 <= expires_in <= 7 * 24 * 3600:
        raise ValueError(f"expires_in must be between 1 and 604800 seconds, not {expires_in}")
    return expires_in
