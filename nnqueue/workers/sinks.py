"""The worker's side of sinks: where the engine may write a job's result, and committing what it wrote.

The engine process holds no store credentials (:mod:`nnqueue.enginecore.sink`). For an S3 store the
worker hands it short-lived presigned PUT URLs for the result's keys, and checks afterwards that the
objects are there with the sizes the engine reported. For the local store it hands it paths in a private
handoff directory on the store's filesystem, and moves the finished files into the store. Results are
per attempt (``results/<job>/<attempt>/...``), so an engine that lost its job cannot overwrite the result
of the worker that took it over.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from nnqueue import isolation
from nnqueue.errors import NNqueueError
from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import ObjectStore, PresignUnsupported
from nnqueue.storage.results import TORCH_AND_SAFETENSORS_FORMAT, TORCH_FORMAT, StoredResult

# The result's objects, by the names the engine reports them under.
OBJECTS = {"torch": TORCH_FILE, "safetensors": SAFETENSORS_FILE}
# Presigned URLs outlive the job by this much (the engine writes at the end of the job).
URL_MARGIN_S = 600
MAX_URL_EXPIRY_S = 7 * 24 * 3600


class ResultNotWritten(NNqueueError):
    """What the engine reported does not match what reached the store."""


@dataclass(frozen=True)
class JobSinks:
    """One attempt's sinks: ``specs`` for the engine, ``keys`` where the objects end up."""

    specs: dict[str, dict[str, str]]
    keys: dict[str, str]


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
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    actual = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                if actual != size:
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
