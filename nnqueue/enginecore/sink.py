"""Where the engine writes one object, described by the frontend as a small JSON dict (a *sink*).

The engine process holds no store credentials: the frontend (:mod:`nnqueue.workers.sinks`) hands it
either a short-lived presigned URL or a file path, and checks and commits what was written afterwards.

* ``{"kind": "presigned_put", "url": str}``: an HTTP PUT of the whole object (S3 and compatible stores).
* ``{"kind": "handoff", "path": str}``: a new file at ``path``, in a directory the frontend owns, which it
  then moves into its local object store.

A writer first writes the object to a local file (:func:`staging_file`), then :func:`deliver` s it; both
report the size and sha256 the frontend records.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from nnqueue.errors import NNqueueError

CHUNK = 1 << 20
PUT_ATTEMPTS = 3
PUT_TIMEOUT_S = 300.0


class SinkError(NNqueueError):
    """The object could not be written to its sink."""


@dataclass(frozen=True)
class Written:
    size: int
    sha256: str


def check(sink: Any) -> dict[str, str]:
    """``sink`` if it is a sink description this module can write to; raises :class:`SinkError`."""
    if isinstance(sink, dict):
        if sink.get("kind") == "presigned_put" and isinstance(sink.get("url"), str):
            return sink
        if sink.get("kind") == "handoff" and isinstance(sink.get("path"), str) and os.path.isabs(sink["path"]):
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
    """PUT the file to a presigned URL, retrying connection failures and 5xx answers."""
    for attempt in range(1, PUT_ATTEMPTS + 1):
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
            if error.code < 500 or attempt == PUT_ATTEMPTS:
                detail = error.read(2000).decode(errors="replace")
                raise SinkError(f"the object store refused the upload: HTTP {error.code} {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            if attempt == PUT_ATTEMPTS:
                raise SinkError(f"the upload to the object store failed: {error}") from None
        time.sleep(0.2 * attempt)
