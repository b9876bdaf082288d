"""Where the engine writes one object, described by the frontend as a small JSON dict (a *sink*).

The engine process holds no store credentials: the frontend (:mod:`nnqueue.workers.sinks`) hands it
either a short-lived presigned URL or a file path, and checks and commits what was written afterwards.

* ``{"kind": "presigned_put", "url": str}``: an HTTP PUT of the whole object (S3 and compatible stores).
* ``{"kind": "handoff", "path": str}``: a new file at ``path``, in a directory the frontend owns, which it
  then moves into its local object store.
* ``{"kind": "multipart", "part_size": int, "urls": [str, ...]}``: an S3 multipart upload through presigned
  part URLs (part ``i + 1`` to ``urls[i]``; every part ``part_size`` bytes but the last; the frontend may
  presign more URLs than the object needs) for objects too large for one PUT; the frontend completes the
  upload with the part ETags :func:`write_stream` returns. Streamed objects only.

A writer either writes the object to a local file (:func:`staging_file`), then :func:`deliver` s it, or
streams it from memory with :func:`write_stream` (harvest shards: no staging copy, hashed as it goes);
both report the size and sha256 the frontend records.
"""

from __future__ import annotations

# urllib encodes host names with the idna codec, imported on first use: too late in an engine process that
# has dropped to the engine user, which may not read the standard library (a Python in root's home).
import encodings.idna  # noqa: F401
import hashlib
import http.client
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from nnqueue.errors import NNqueueError

CHUNK = 1 << 20
PUT_TIMEOUT_S = 300.0
# How long a PUT keeps retrying a store that cannot be reached or answers 5xx (backing off from 0.2 s to 5 s):
# long enough to ride out a store's restart, short of a presigned URL's lifetime.
PUT_RETRY_S = 120.0


class SinkError(NNqueueError):
    """The object could not be written to its sink."""


@dataclass(frozen=True)
class Written:
    size: int
    sha256: str
    parts: tuple[dict[str, Any], ...] = ()  # multipart: {"part_number", "etag"} of each part written


def check(sink: Any) -> dict[str, str]:
    """``sink`` if it is a sink description this module can write to; raises :class:`SinkError`."""
    if isinstance(sink, dict):
        if sink.get("kind") == "presigned_put" and isinstance(sink.get("url"), str):
            return sink
        if sink.get("kind") == "handoff" and isinstance(sink.get("path"), str) and os.path.isabs(sink["path"]):
            return sink
        if (
            sink.get("kind") == "multipart"
            and isinstance(sink.get("part_size"), int)
            and sink["part_size"] > 0
            and isinstance(sink.get("urls"), list)
            and all(isinstance(url, str) for url in sink["urls"])
        ):
            return sink
    raise SinkError(f"not a sink description: {sink!r}")


def staging_file(sink: dict[str, str]) -> str:
    """A new empty file to write the object into before :func:`deliver`: beside a handoff path (so that
    delivering is a rename), in the temporary directory for an upload."""
    directory = os.path.dirname(sink["path"]) if sink["kind"] == "handoff" else None
    fd, path = tempfile.mkstemp(prefix=".nnqueue-", suffix=".partial", dir=directory)
    os.close(fd)
    return path


def deliver(sink: dict[str, str], staged: str) -> Written:
    """Move the finished file ``staged`` to ``sink`` (consuming it) and return its size and sha256."""
    try:
        written = _digest(staged)
        if sink["kind"] == "handoff":
            with open(staged, "rb") as file:
                os.fsync(file.fileno())
            os.replace(staged, sink["path"])
        else:
            _put(sink["url"], staged, written.size)
        return written
    finally:
        if os.path.exists(staged):
            os.unlink(staged)


def _digest(path: str) -> Written:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return Written(size, digest.hexdigest())


def _put(url: str, path: str, size: int) -> None:
    """PUT the file to a presigned URL, retrying connection failures and 5xx answers for ``PUT_RETRY_S``."""
    deadline, delay = time.monotonic() + PUT_RETRY_S, 0.2
    while True:
        try:
            with open(path, "rb") as body:
                request = urllib.request.Request(
                    url,
                    data=body,
                    method="PUT",
                    headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
                )
                with urllib.request.urlopen(request, timeout=PUT_TIMEOUT_S) as response:
                    response.read()
            return
        except urllib.error.HTTPError as error:
            if error.code < 500 or time.monotonic() + delay > deadline:
                detail = error.read(2000).decode(errors="replace")
                raise SinkError(f"the object store refused the upload: HTTP {error.code} {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            if time.monotonic() + delay > deadline:
                raise SinkError(f"the upload to the object store failed for {PUT_RETRY_S:g} s: {error}") from None
        time.sleep(delay)
        delay = min(2 * delay, 5.0)


def write_stream(sink: dict[str, Any], size: int, pieces: Iterable[bytes | memoryview]) -> Written:
    """Write the ``size`` bytes of ``pieces`` to ``sink``, hashing them on the way (no staging copy)."""
    sink = check(sink)
    digest = hashlib.sha256()
    counted = _Counted(pieces, digest)
    parts: tuple[dict[str, Any], ...] = ()
    if sink["kind"] == "handoff":
        staged = staging_file(sink)
        try:
            with open(staged, "wb") as file:
                for piece in counted:
                    file.write(piece)
                file.flush()
                os.fsync(file.fileno())
            os.replace(staged, sink["path"])
        finally:
            if os.path.exists(staged):
                os.unlink(staged)
    elif sink["kind"] == "presigned_put":
        _put_stream(sink["url"], size, counted)
    else:
        parts = _multipart(sink, size, counted)
    if counted.size != size:
        raise SinkError(f"wrote {counted.size} bytes, expected {size}")
    return Written(size, digest.hexdigest(), parts)


class _Counted:
    """The pieces as byte views, hashed and counted as they pass."""

    def __init__(self, pieces: Iterable[bytes | memoryview], digest: Any) -> None:
        self.pieces, self.digest, self.size = iter(pieces), digest, 0

    def __iter__(self) -> Iterator[memoryview]:
        for piece in self.pieces:
            view = memoryview(piece).cast("B")
            self.digest.update(view)
            self.size += view.nbytes
            yield view


def _put_stream(url: str, size: int, pieces: Iterable[memoryview]) -> str:
    """PUT ``size`` streamed bytes to a presigned ``url`` (no retry: the stream is consumed); its ETag."""
    target = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(target.netloc, timeout=PUT_TIMEOUT_S)
    try:
        connection.putrequest(
            "PUT", target.path + (f"?{target.query}" if target.query else ""), skip_accept_encoding=True
        )
        connection.putheader("Content-Length", str(size))
        connection.putheader("Content-Type", "application/octet-stream")
        connection.endheaders()
        for piece in pieces:
            connection.send(piece)
        response = connection.getresponse()
        body = response.read(2000)
        if response.status // 100 != 2:
            raise SinkError(
                f"the object store refused the upload: HTTP {response.status} {body.decode(errors='replace')}"
            )
        return response.getheader("ETag", "")
    except OSError as error:
        raise SinkError(f"the upload to the object store failed: {error}") from None
    finally:
        connection.close()


def _multipart(sink: dict[str, Any], size: int, pieces: Iterable[memoryview]) -> tuple[dict[str, Any], ...]:
    part_size, urls = sink["part_size"], sink["urls"]
    count = max(1, -(-size // part_size))
    if count > len(urls):
        raise SinkError(f"{size} bytes need {count} parts of {part_size} bytes; the sink has {len(urls)} part URLs")
    stream, parts = _Parts(pieces), []
    for index in range(count):
        length = min(part_size, size - index * part_size)
        parts.append({"part_number": index + 1, "etag": _put_stream(urls[index], length, stream.take(length))})
    return tuple(parts)


class _Parts:
    """Cuts a stream of byte views into consecutive runs of given lengths, without copying."""

    def __init__(self, pieces: Iterable[memoryview]) -> None:
        self.pieces, self.rest = iter(pieces), memoryview(b"")

    def take(self, length: int) -> Iterator[memoryview]:
        while length > 0:
            if not self.rest:
                self.rest = next(self.pieces, memoryview(b""))
                if not self.rest:
                    return
            piece, self.rest = self.rest[:length], self.rest[length:]
            length -= piece.nbytes
            yield piece
