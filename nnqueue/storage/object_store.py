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

import hashlib
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

    def follow_file(self, key: str, fileobj: BinaryIO, size_hint: int | None = None) -> FileUpload:
        """An upload of the regular file ``fileobj`` to ``key`` while its writer still appends to it:
        :meth:`FileUpload.advance` may send what is written so far, :meth:`FileUpload.finish` sends the rest and
        stores the object (nothing appears before), :meth:`FileUpload.abort` drops it. Here all of it goes at the
        finish; a backend with parts sends them on the way."""
        return FileUpload(self, key, fileobj, size_hint)

    @abstractmethod
    def open_writer(self, key: str, size_hint: int | None = None) -> ObjectWriter:
        """A staged write of ``key``: :meth:`ObjectWriter.write` the bytes as they come (bounded memory: parts
        of a multipart upload, or a temporary file), then :meth:`ObjectWriter.commit` (the object appears, whole)
        or :meth:`ObjectWriter.abort` (nothing appears). The writer counts and hashes every byte written."""

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


@dataclass(frozen=True)
class Digest:
    """The size and sha256 (hex) of exactly the bytes an :class:`ObjectWriter` stored."""

    size: int
    sha256: str


class ObjectWriter(ABC):
    """One object written a piece at a time (see :meth:`ObjectStore.open_writer`); use from one thread."""

    def __init__(self, key: str) -> None:
        self.key = validate_key(key)
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._digest.update(data)
        self.size += len(data)
        self._write(data)

    def commit(self) -> Digest:
        """Store the bytes written as the object (replacing any); their size and sha256."""
        self._commit()
        return Digest(self.size, self._digest.hexdigest())

    @abstractmethod
    def _write(self, data: bytes | memoryview) -> None: ...

    @abstractmethod
    def _commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written; the store keeps what it had. Safe to call after a failed commit."""


class FileUpload:
    """See :meth:`ObjectStore.follow_file`; use from one thread at a time."""

    def __init__(self, store: ObjectStore, key: str, fileobj: BinaryIO, size_hint: int | None) -> None:
        self.store, self.key, self.file, self.size_hint = store, validate_key(key), fileobj, size_hint

    def advance(self, written: int) -> None:
        """The file's first ``written`` bytes are final: send what of them may go now (never blocks on the store)."""

    def finish(self, size: int) -> int:
        """The file is complete at ``size`` bytes: store them; their count."""
        self.file.seek(0)
        stored = self.store.put_stream(self.key, self.file, size_hint=size)
        if stored != size:
            self.store.delete(self.key)
            raise ObjectStoreError(f"the file had {stored} bytes at its upload, not {size}")
        return stored

    def abort(self) -> None:
        """Drop what was sent; nothing appears at the key. Safe after a failed finish."""


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
