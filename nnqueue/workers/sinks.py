"""The worker's side of sinks: where the engine leaves a job's result or a harvest chunk's shard, and the
upload of what it left, which this process does itself.

The engine process runs users' code, holds no store credentials and has no network
(:mod:`nnqueue.enginecore.sink`, :mod:`nnqueue.netns`). It writes results and shards to files in a private
handoff directory, hashing them as it writes, and reports each file's size and sha256; this worker checks the
file it finds there (opened without following a link, a regular file with one link, the reported size, owned
by the engine's user or this worker's: never a file of someone else's that the engine linked there), then
streams it from that open file to the store (:meth:`nnqueue.storage.object_store.ObjectStore.put_stream`: an S3
multipart upload for large objects, parts read from the file once; a local store copies it in the kernel)
and records the size and the engine's sha256 with the job or chunk, which the API hands to clients and the
clients check (:mod:`nnqueue.workers.job_execution`, :mod:`nnqueue.scheduler.harvest_manifest`). Nothing the
engine holds reaches the store: no URL, no credential; so an engine that a trace took over can forge the
results of the steps it runs (and report a sha256 that does not match them, which the clients' check then
refuses), but cannot replace a committed one, and a change made to a stored object behind the worker's back
no longer matches its recorded sha256.

A handoff file is read once, by the upload, and removed. Results are per attempt
(``results/<job>/<attempt>/...``), so a worker that lost its job cannot overwrite the new holder's result;
a shard's key is its chunk's (a re-run writes the same bytes), and a worker that lost its chunk removes its
file instead of uploading it. A shard larger than the bound its chunk allows is refused (`open_shard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nnqueue import isolation
from nnqueue.errors import NNqueueError
from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import Digest, ObjectStore
from nnqueue.storage.results import TORCH_AND_SAFETENSORS_FORMAT, TORCH_FORMAT, StoredResult

# The result's objects, by the names the engine reports them under.
OBJECTS = {"torch": TORCH_FILE, "safetensors": SAFETENSORS_FILE}


class ResultNotWritten(NNqueueError):
    """What the engine reported does not match what it left for the worker."""


class Reported(Protocol):
    """What the engine reported writing: the size and sha256 (hex) of one object."""

    @property
    def size(self) -> int: ...

    @property
    def sha256(self) -> str: ...


@dataclass(frozen=True)
class JobSinks:
    """One attempt's sinks: ``specs`` for the engine, ``keys`` where the objects end up."""

    specs: dict[str, dict[str, str]]
    keys: dict[str, str]


@dataclass(frozen=True)
class ShardSink:
    """Where the engine writes one chunk's shard: ``spec`` for the engine (a handoff file), ``key`` where the shard
    ends up, ``max_bytes`` the most it may hold."""

    spec: dict[str, str]
    key: str
    max_bytes: int


class ResultSinks:
    def __init__(self, store: ObjectStore, handoff_root: Path) -> None:
        self.store = store
        self.handoff_root = handoff_root
        self._handoff_dir: Path | None = None

    def open(self, job_id: uuid.UUID, attempt: int, *, safetensors: bool) -> JobSinks:
        """Files for the engine to leave the result of ``job_id``'s ``attempt`` in: ``saves.pt``, and with
        ``safetensors`` a sink the engine fills when every saved value is a tensor."""
        directory = self._handoff()
        objects = {name: file for name, file in OBJECTS.items() if safetensors or name != "safetensors"}
        specs = {
            name: {"kind": "handoff", "path": str(directory / f"{job_id}-{attempt}-{file}")}
            for name, file in objects.items()
        }
        keys = {name: result_key(job_id, file, attempt) for name, file in objects.items()}
        return JobSinks(specs, keys)

    @contextlib.asynccontextmanager
    async def staged_result(self, job_id: uuid.UUID, attempt: int, *, safetensors: bool) -> AsyncIterator[JobSinks]:
        """`open` for an async executor: what the attempt left in the handoff directory is removed on leaving,
        whether its result was committed (`commit`), there was none, or the attempt failed. Both on the calling
        loop: naming the files (the directory is made once) and unlinking what is left (usually nothing: `commit`
        removed it) cost less than the two thread hops they took, which hundreds of jobs in flight queued behind
        each other's uploads (issue 36)."""
        sinks = self.open(job_id, attempt, safetensors=safetensors)
        try:
            yield sinks
        finally:
            self.discard(sinks)

    def commit(self, sinks: JobSinks, written: Mapping[str, Reported]) -> StoredResult:
        """Upload the objects the engine reported writing (name -> size and sha256) from their handoff files;
        raises :class:`ResultNotWritten` when a file does not hold what was reported. A blocking call."""
        if "torch" not in written:
            raise ResultNotWritten("the engine reported no saves.pt")
        if unknown := set(written) - set(sinks.specs):
            raise ResultNotWritten(f"the engine reported {len(unknown)} object(s) it was given no sink for")
        digests = {
            name: self._upload(sinks.specs[name]["path"], sinks.keys[name], reported, name)
            for name, reported in written.items()
        }
        self.discard(sinks)
        fmt = TORCH_AND_SAFETENSORS_FORMAT if "safetensors" in digests else TORCH_FORMAT
        torch = digests["torch"]
        return StoredResult(sinks.keys["torch"], torch.size, fmt, torch.sha256, digests.get("safetensors"))

    def put_result(self, job_id: uuid.UUID, attempt: int, name: str, data: bytes, fmt: str = "json") -> StoredResult:
        """Upload a result this worker made itself (a steering job's generations) as ``name`` of the attempt,
        hashing what is uploaded. A blocking call."""
        writer = self.store.open_writer(result_key(job_id, name, attempt), size_hint=len(data))
        try:
            writer.write(data)
            digest = writer.commit()
        except BaseException:
            writer.abort()
            raise
        return StoredResult(result_key(job_id, name, attempt), digest.size, fmt, digest.sha256)

    def discard(self, sinks: JobSinks) -> None:
        """Remove what an attempt left in the handoff directory."""
        for spec in sinks.specs.values():
            Path(spec["path"]).unlink(missing_ok=True)

    def open_shard(self, key: str, name: str, max_bytes: int) -> ShardSink:
        """A handoff file named ``name`` (unique to the attempt) for a shard of at most ``max_bytes`` bytes, to end
        up at ``key`` (`commit_shard`)."""
        return ShardSink({"kind": "handoff", "path": str(self._handoff() / name)}, key, max_bytes)

    @contextlib.asynccontextmanager
    async def staged_shard(self, key: str, name: str, max_bytes: int) -> AsyncIterator[ShardSink]:
        """`open_shard` for an async executor: the handoff file is removed on leaving, whether the shard was
        committed (`commit_shard`), abandoned or its attempt failed, so nothing outlives the attempt."""
        sink = await asyncio.to_thread(self.open_shard, key, name, max_bytes)
        try:
            yield sink
        finally:
            await asyncio.to_thread(self.discard_shard, sink)

    def commit_shard(self, sink: ShardSink, reported: Reported) -> Digest:
        """Upload the shard the engine reported writing; its size and sha256. Raises :class:`ResultNotWritten` when
        the file differs from the report or is larger than the sink allows. Blocking. The file is removed."""
        try:
            if reported.size > sink.max_bytes:
                raise ResultNotWritten(f"the shard has {reported.size} bytes, over its bound of {sink.max_bytes}")
            return self._upload(sink.spec["path"], sink.key, reported, "the shard")
        finally:
            self.discard_shard(sink)

    def discard_shard(self, sink: ShardSink) -> None:
        """Drop what an abandoned attempt wrote (nothing appears at the key)."""
        Path(sink.spec["path"]).unlink(missing_ok=True)

    def _upload(self, path: str, key: str, reported: Reported, name: str) -> Digest:
        """Stream the handoff file at ``path`` to ``key`` once it is checked against ``reported`` (see the module
        doc); its size and the engine's sha256."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the engine may have made it a link
        except OSError as error:
            raise ResultNotWritten(f"{name} was not handed off: {error.strerror}") from None
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid not in self._owners():
                raise ResultNotWritten(f"{name} was not handed off as a file of the engine's own")
            if info.st_size != reported.size:
                raise ResultNotWritten(f"{name} handed off with {info.st_size} bytes, reported {reported.size}")
            uploaded = self.store.put_stream(key, file, size_hint=reported.size)
        if uploaded != reported.size:
            self.store.delete(key)
            raise ResultNotWritten(f"{name} changed while it was read: {uploaded} bytes, reported {reported.size}")
        return Digest(uploaded, reported.sha256)

    def _owners(self) -> set[int]:
        """Who a handoff file may belong to: the engine's user (when this worker is root and has one) or this
        worker's (an engine that keeps it)."""
        owners = {os.geteuid()}
        if os.geteuid() == 0:
            try:
                account = isolation.engine_user()
            except ValueError:  # no such account: the engine keeps root
                account = None
            if account is not None:
                owners.add(account.uid)
        return owners

    def _handoff(self) -> Path:
        if self._handoff_dir is None:
            # The engine writes here. A root worker's engine runs as the engine user (nnqueue.isolation),
            # which may not reach the store's folder: its handoff directory is then in the temp folder (1777).
            parent = None if os.geteuid() == 0 else self.handoff_root
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            self._handoff_dir = isolation.engine_writable_dir("nnqueue-handoff-", parent=parent)
        return self._handoff_dir
