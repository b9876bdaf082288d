"""The worker's side of sinks: where the engine may write a job's result or a harvest chunk's shard, and
committing what it wrote.

The engine process holds no store credentials (:mod:`nnqueue.enginecore.sink`). For an S3 store the
worker hands it short-lived presigned URLs, and checks afterwards that the objects are there with the sizes
the engine reported: a PUT URL per result object, and for a shard (too large for one PUT, of a size known
only once written) a presigned multipart upload with part URLs for an upper bound of its size, which the
worker completes from the part ETags the engine reports. For the local store it hands it paths in a private
handoff directory on the store's filesystem, and moves the finished files into the store. Results are per
attempt (``results/<job>/<attempt>/...``), so an engine that lost its job cannot overwrite the result of the
worker that took it over; a shard's key is its chunk's (a re-run writes the same bytes), and a worker that
lost its chunk aborts its upload or drops its handoff file instead of committing it.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnqueue import isolation
from nnqueue.errors import NNqueueError
from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import MultipartUpload, ObjectStore, PresignUnsupported
from nnqueue.storage.results import TORCH_AND_SAFETENSORS_FORMAT, TORCH_FORMAT, StoredResult

# The result's objects, by the names the engine reports them under.
OBJECTS = {"torch": TORCH_FILE, "safetensors": SAFETENSORS_FILE}
# Presigned URLs outlive the job by this much (the engine writes at the end of the job).
URL_MARGIN_S = 600
MAX_URL_EXPIRY_S = 7 * 24 * 3600
# A shard's multipart upload: parts of at least MIN_PART_BYTES (S3 wants 5 MiB but for the last part), and at
# most MAX_SHARD_PARTS part URLs handed to the engine (their part size grows with the bound instead).
MIN_PART_BYTES = 8 * 1024 * 1024
MAX_SHARD_PARTS = 1000


class ResultNotWritten(NNqueueError):
    """What the engine reported does not match what reached the store."""


@dataclass(frozen=True)
class JobSinks:
    """One attempt's sinks: ``specs`` for the engine, ``keys`` where the objects end up."""

    specs: dict[str, dict[str, str]]
    keys: dict[str, str]


@dataclass(frozen=True)
class ShardSink:
    """Where the engine writes one chunk's shard: ``spec`` for the engine, ``key`` where the shard ends up, and
    the multipart ``upload`` the worker completes (None: a handoff file)."""

    spec: dict[str, Any]
    key: str
    upload: MultipartUpload | None = None


class ResultSinks:
    def __init__(self, store: ObjectStore, handoff_root: Path) -> None:
        self.store = store
        self.handoff_root = handoff_root
        self._handoff_dir: Path | None = None

    def open(self, job_id: uuid.UUID, attempt: int, timeout_s: float) -> JobSinks:
        """Sinks for the result of ``job_id``'s ``attempt``; may call the store (a blocking call)."""
        keys = {name: result_key(job_id, file, attempt) for name, file in OBJECTS.items()}
        expiry = int(min(timeout_s + URL_MARGIN_S, MAX_URL_EXPIRY_S))
        try:
            specs = {
                name: {"kind": "presigned_put", "url": self.store.presigned_put_url(key, expiry)}
                for name, key in keys.items()
            }
        except PresignUnsupported:
            directory = self._handoff()
            specs = {
                name: {"kind": "handoff", "path": str(directory / f"{job_id}-{attempt}-{file}")}
                for name, file in OBJECTS.items()
            }
        return JobSinks(specs, keys)

    def commit(self, sinks: JobSinks, written: dict[str, int]) -> StoredResult:
        """Record the objects the engine reported writing (name -> size), moving handed-off files into the
        store; raises :class:`ResultNotWritten` when the store does not hold what was reported."""
        if "torch" not in written:
            raise ResultNotWritten("the engine reported no saves.pt")
        for name, size in written.items():
            spec, key = sinks.specs[name], sinks.keys[name]
            if spec["kind"] == "handoff":
                path = spec["path"]
                if (actual := self._handed_off_size(path)) != size:
                    raise ResultNotWritten(f"{name} handed off with {actual} bytes, reported {size}")
                self.store.put_file(key, path)
            elif (actual := self.store.size(key)) != size:
                raise ResultNotWritten(f"{name} in the store has {actual} bytes, reported {size}")
        fmt = TORCH_AND_SAFETENSORS_FORMAT if "safetensors" in written else TORCH_FORMAT
        return StoredResult(sinks.keys["torch"], written["torch"], fmt)

    def discard(self, sinks: JobSinks) -> None:
        """Remove what an abandoned attempt handed off (uploaded objects stay, unreferenced, under its attempt)."""
        for spec in sinks.specs.values():
            if spec["kind"] == "handoff":
                Path(spec["path"]).unlink(missing_ok=True)

    def open_shard(self, key: str, name: str, max_bytes: int, expires_s: int) -> ShardSink:
        """A sink for a shard of at most ``max_bytes`` bytes, to end up at ``key``: a presigned multipart upload,
        or the handoff file ``name`` (unique to the attempt). May call the store (a blocking call)."""
        part_size = max(MIN_PART_BYTES, math.ceil(max_bytes / MAX_SHARD_PARTS))
        parts = max(1, math.ceil(max_bytes / part_size))
        try:
            upload = self.store.presigned_multipart(key, parts, min(expires_s, MAX_URL_EXPIRY_S))
        except PresignUnsupported:
            return ShardSink({"kind": "handoff", "path": str(self._handoff() / name)}, key)
        return ShardSink({"kind": "multipart", "part_size": part_size, "urls": upload.urls}, key, upload)

    def commit_shard(self, sink: ShardSink, size: int, etags: Sequence[str]) -> None:
        """Put the shard the engine reported writing (``size`` bytes; ``etags`` of its parts, in order) at its key;
        raises :class:`ResultNotWritten` when the store does not hold what was reported."""
        if sink.upload is None:
            actual = self._handed_off_size(sink.spec["path"])
            if actual != size:
                raise ResultNotWritten(f"the shard was handed off with {actual} bytes, reported {size}")
            self.store.put_file(sink.key, sink.spec["path"])
        elif (actual := self.store.complete_multipart(sink.upload, list(etags))) != size:
            raise ResultNotWritten(f"the shard in the store has {actual} bytes, reported {size}")

    def discard_shard(self, sink: ShardSink) -> None:
        """Drop what an abandoned attempt wrote: its handoff file, or its unfinished upload's parts."""
        if sink.upload is None:
            Path(sink.spec["path"]).unlink(missing_ok=True)
        else:
            self.store.abort_multipart(sink.upload)

    @staticmethod
    def _handed_off_size(path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # the engine process (untrusted) may have made it a link
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _handoff(self) -> Path:
        if self._handoff_dir is None:
            # The engine writes here. A root worker's engine runs as the engine user (nnqueue.isolation),
            # which may not reach the store's folder: its handoff directory is then in the temp folder
            # (1777), and committing a result copies it when that is another filesystem.
            parent = None if os.geteuid() == 0 else self.handoff_root
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            self._handoff_dir = isolation.engine_writable_dir("nnqueue-handoff-", parent=parent)
        return self._handoff_dir
