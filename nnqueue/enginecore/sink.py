"""Where the engine writes one object, described by the frontend as a small JSON dict (a *sink*).

The engine process holds no store credentials and has no network (:mod:`nnqueue.netns`): every object
leaves it through a file that the frontend (:mod:`nnqueue.workers.sinks`) reads, hashes and uploads
itself. The engine never holds anything that could write to the store, so nothing it does can replace an
object once the frontend committed it.

* ``{"kind": "handoff", "path": str}``: a new file at ``path``, in a directory the frontend owns, which it
  then reads into the store (a trace's result).
* ``{"kind": "pipe", "path": str}``: a FIFO the frontend made and reads while the engine writes into it, so
  that its upload runs alongside the write and no copy of the object sits on disk (a harvest shard).
  Streamed objects only.

A writer either writes the object to a local file (:func:`staging_file`), then :func:`deliver` s it, or
streams it from memory with :func:`write_stream` (harvest shards: no staging copy, hashed as it goes);
both report the size and sha256 of what they wrote, which the frontend checks against what it read.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nnqueue.errors import NNqueueError

CHUNK = 1 << 20


class SinkError(NNqueueError):
    """The object could not be written to its sink."""


@dataclass(frozen=True)
class Written:
    size: int
    sha256: str


def check(sink: Any) -> dict[str, str]:
    """``sink`` if it is a sink description this module can write to; raises :class:`SinkError`."""
    if (
        isinstance(sink, dict)
        and sink.get("kind") in ("handoff", "pipe")
        and isinstance(sink.get("path"), str)
        and os.path.isabs(sink["path"])
    ):
        return sink
    raise SinkError(f"not a sink description: {sink!r}")


def staging_file(sink: dict[str, str]) -> str:
    """A new empty file beside the handoff path to write the object into before :func:`deliver` (a rename)."""
    if check(sink)["kind"] != "handoff":
        raise SinkError(f"a {sink['kind']} sink takes streamed objects only")
    fd, path = tempfile.mkstemp(prefix=".nnqueue-", suffix=".partial", dir=os.path.dirname(sink["path"]))
    os.close(fd)
    return path


def deliver(sink: dict[str, str], staged: str) -> Written:
    """Move the finished file ``staged`` to ``sink`` (consuming it) and return its size and sha256. The file is
    not fsynced: the frontend reads it at once, and its upload is what lasts."""
    try:
        written = _digest(staged)
        os.replace(staged, sink["path"])
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


def write_stream(sink: dict[str, Any], size: int, pieces: Iterable[bytes | memoryview]) -> Written:
    """Write the ``size`` bytes of ``pieces`` to ``sink``, hashing them on the way (no staging copy on a pipe)."""
    sink = check(sink)
    digest, count = hashlib.sha256(), 0
    if sink["kind"] == "handoff":
        staged = staging_file(sink)
        opened = open(staged, "wb")  # noqa: SIM115 - closed below, before the rename
    else:
        # The frontend made the FIFO and reads it: open it as it is (never a file someone put in its place).
        fd = os.open(sink["path"], os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            raise SinkError(f"{sink['path']} is not the frontend's pipe")
        staged, opened = "", os.fdopen(fd, "wb")
    try:
        with opened as file:
            for piece in pieces:
                view = memoryview(piece).cast("B")
                digest.update(view)
                count += view.nbytes
                file.write(view)
        if count != size:
            raise SinkError(f"wrote {count} bytes, expected {size}")
        if staged:
            os.replace(staged, sink["path"])
    except BrokenPipeError:
        raise SinkError("the frontend stopped reading the shard (the chunk was abandoned)") from None
    finally:
        if staged and os.path.exists(staged):
            os.unlink(staged)
    return Written(size, digest.hexdigest())
