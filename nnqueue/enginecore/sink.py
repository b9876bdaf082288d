"""Where the engine writes one object, described by the frontend as a small JSON dict (a *sink*).

The engine process holds no store credentials and has no network (:mod:`nnqueue.netns`): every object
leaves it through a file that the frontend (:mod:`nnqueue.workers.sinks`) checks and uploads itself. The
engine never holds anything that could write to the store, so nothing it does can replace an object once
the frontend committed it.

``{"kind": "handoff", "path": str}``: a new file at ``path``, in a private directory the frontend made for
the engine (a trace's result, a harvest shard). The object is written to a staging file beside it
(`staging_path`: the frontend may upload a shard's first parts while the rest is being written) and renamed there
when complete; its sha256 is computed from the bytes as they are written (:class:`HashingFile`),
never by reading the file again, and reported with its size. The frontend checks the file it finds (a
regular file, not a link, the reported size, the engine's owner) and uploads it from there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

from nnqueue.errors import NNqueueError


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
        and sink.get("kind") == "handoff"
        and isinstance(sink.get("path"), str)
        and os.path.isabs(sink["path"])
    ):
        return sink
    raise SinkError(f"not a sink description: {sink!r}")


# Pieces from this size on are hashed on a helper thread while the calling thread writes them (both release the
# GIL): a piece then costs the longer of the two, not their sum.
OVERLAP_BYTES = 1 << 20
_hashers = ThreadPoolExecutor(8, thread_name_prefix="nnqueue-sink-hash")


class HashingFile:
    """A binary file being written that hashes (sha256) and counts every byte written through it: what
    ``torch.save`` and the shard writer write to."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < OVERLAP_BYTES:
            self.digest.update(view)
            self.file.write(view)
        else:
            hashed = _hashers.submit(self.digest.update, view)
            try:
                self.file.write(view)
            finally:
                hashed.result()  # before returning: the caller may reuse its buffer
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.file.flush()

    def written(self) -> Written:
        return Written(self.size, self.digest.hexdigest())


def staging_path(target: str) -> str:
    """Where the object for ``target`` is written before it is renamed there: ``.<name>.partial`` beside it."""
    folder, name = os.path.split(target)
    return os.path.join(folder, f".{name}.partial")


def write_file(sink: dict[str, Any], save: Callable[[HashingFile], object]) -> Written:
    """Run ``save`` on a staging file beside the sink's path, hashing what it writes, then rename the complete
    file to the path; its size and sha256. The file is not fsynced: the frontend uploads it at once, and its
    upload is what lasts."""
    target = check(sink)["path"]
    staged = staging_path(target)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            hashing = HashingFile(file)
            save(hashing)
        os.replace(staged, target)
        return hashing.written()
    finally:
        if os.path.exists(staged):
            os.unlink(staged)


def write_stream(sink: dict[str, Any], size: int, pieces: Iterable[bytes | memoryview]) -> Written:
    """Write the ``size`` bytes of ``pieces`` to ``sink`` (see `write_file`)."""

    def save(file: HashingFile) -> None:
        for piece in pieces:
            file.write(piece)
        if file.size != size:
            raise SinkError(f"wrote {file.size} bytes, expected {size}")

    return write_file(sink, save)
