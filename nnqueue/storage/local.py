"""The object store in a local directory, for the embedded single-machine default.

A key ``a/b/c`` is the file ``<root>/a/b/c``. Writes go to a temporary file in the target's own
directory, are fsynced, then renamed over the target with ``os.replace``, which is atomic on POSIX:
a reader (even one in another process) sees the old object or the new one, never a partial one, and
an open reader keeps reading the version it opened.
"""

from __future__ import annotations

import io
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

from nnqueue.storage.object_store import (
    ObjectNotFound,
    ObjectReader,
    ObjectStore,
    ObjectWriter,
    PresignUnsupported,
    validate_key,
    validate_range,
)

CHUNK_SIZE = 1024 * 1024
# Objects are plain files readable by other local users (e.g. an API server under another account).
FILE_MODE = 0o644
# What a key that names a directory or passes through a file raises; both mean "no such object".
_MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


class LocalObjectStore(ObjectStore):
    """Objects as files under ``root`` (created if missing). ``put_stream`` ignores ``size_hint``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def put_bytes(self, key: str, data: bytes) -> int:
        return self.put_stream(key, io.BytesIO(data))

    def put_stream(self, key: str, fileobj: BinaryIO, size_hint: int | None = None) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as tmp:
                size = _copy(fileobj, tmp)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.chmod(tmp_name, FILE_MODE)
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)  # make the rename itself durable
        return size

    def open_writer(self, key: str, size_hint: int | None = None) -> ObjectWriter:
        return _FileWriter(key, self._path(key))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        start, end = validate_range(start, end)
        with self._open(key) as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    def open_stream(self, key: str) -> ObjectReader:
        return self._open(key)

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        return path.stat().st_size

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except _MISSING:
            pass

    def list_keys(self, prefix: str) -> list[str]:
        # Walk only the deepest folder the prefix names; skip writes in progress (".<name>.<random>.tmp").
        folder = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not folder.is_dir() or not folder.resolve().is_relative_to(self.root):
            return []
        keys = (path.relative_to(self.root).as_posix() for path in folder.rglob("*") if path.is_file())
        return sorted(key for key in keys if key.startswith(prefix) and not _in_progress(key))

    def presigned_get_url(self, key: str, expires_in: int) -> str:
        raise PresignUnsupported(
            f"the local object store ({self.root}) cannot presign URLs; stream the object through "
            "the API instead, or configure an S3 store (NNQUEUE_S3__*) for direct downloads"
        )

    def _path(self, key: str) -> Path:
        # validate_key rejects empty, '.' and '..' segments, a leading '/' and backslashes, so the
        # joined path always stays under root.
        return self.root / validate_key(key)

    def _open(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except _MISSING as exc:
            raise ObjectNotFound(key) from exc


class _FileWriter(ObjectWriter):
    """A temporary file beside the target, renamed over it at commit (as ``put_stream`` does)."""

    def __init__(self, key: str, path: Path) -> None:
        super().__init__(key)
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self.file = os.fdopen(fd, "wb")

    def _write(self, data: bytes | memoryview) -> None:
        self.file.write(data)

    def _commit(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.chmod(self.tmp_name, FILE_MODE)
            os.replace(self.tmp_name, self.path)
        except BaseException:
            self.abort()
            raise
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        self.file.close()
        Path(self.tmp_name).unlink(missing_ok=True)


def _in_progress(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return name.startswith(".") and name.endswith(".tmp")


def _copy(src: BinaryIO, dst: BinaryIO) -> int:
    """Copy ``src`` from its position to ``dst``: in the kernel (``sendfile``) when it is a regular file (a handoff
    file of the engine's, nnqueue.workers.sinks), else through a buffer."""
    try:
        source = src.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        source = -1
    if source >= 0 and stat.S_ISREG(os.fstat(source).st_mode):
        dst.flush()
        size = 0
        while sent := os.sendfile(dst.fileno(), source, None, 1 << 30):
            size += sent
        return size
    size = 0
    while chunk := src.read(CHUNK_SIZE):
        dst.write(chunk)
        size += len(chunk)
    return size


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
