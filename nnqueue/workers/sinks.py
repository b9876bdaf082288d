"""The worker's side of sinks: where the engine leaves a job's result or a harvest chunk's shard, and the
upload of what it left, which this process does itself.

The engine process runs users' code, holds no store credentials and has no network
(:mod:`nnqueue.enginecore.sink`, :mod:`nnqueue.netns`). It writes results to files in a private handoff
directory and shards into a pipe (a FIFO there); this worker reads them, uploads them (a staged write:
:meth:`nnqueue.storage.object_store.ObjectStore.open_writer`, an S3 multipart upload for large objects) and
records the size and sha256 of exactly the bytes it uploaded, which the API hands to clients and the
clients check (:mod:`nnqueue.workers.job_execution`, :mod:`nnqueue.scheduler.harvest_manifest`). Nothing the
engine holds reaches the store: no URL, no credential; so an engine that a trace took over can forge the
results of the steps it runs, but cannot replace a committed one, and a change made to a stored object
behind the worker's back no longer matches its recorded sha256.

A shard's upload runs while the engine writes it (the worker reads the pipe as the bytes come, uploading
parts as they fill): disk use is none, memory a few parts. A handoff file the engine reported is read once,
checked against the size the engine reported, and removed. Results are per attempt
(``results/<job>/<attempt>/...``), so a worker that lost its job cannot overwrite the new holder's result;
a shard's key is its chunk's (a re-run writes the same bytes), and a worker that lost its chunk aborts its
upload instead of committing it.
"""

from __future__ import annotations

import fcntl
import os
import select
import stat
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nnqueue import isolation
from nnqueue.errors import NNqueueError
from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import Digest, ObjectStore, ObjectWriter
from nnqueue.storage.results import TORCH_AND_SAFETENSORS_FORMAT, TORCH_FORMAT, StoredResult

# The result's objects, by the names the engine reports them under.
OBJECTS = {"torch": TORCH_FILE, "safetensors": SAFETENSORS_FILE}
CHUNK = 1 << 20
# A shard's pipe: a larger kernel buffer than the default 64 KiB (fewer wake-ups on both sides), and how often a
# read that waits for the engine looks whether the chunk was abandoned.
PIPE_BYTES = 1 << 20
POLL_MS = 200
_F_SETPIPE_SZ = 1031


class ResultNotWritten(NNqueueError):
    """What the engine reported does not match what it left for the worker."""


@dataclass(frozen=True)
class JobSinks:
    """One attempt's sinks: ``specs`` for the engine, ``keys`` where the objects end up."""

    specs: dict[str, dict[str, str]]
    keys: dict[str, str]


@dataclass
class ShardSink:
    """Where the engine writes one chunk's shard: ``spec`` for the engine (a pipe), ``key`` where the shard ends
    up; the worker's end of the pipe, the staged upload and what it read (``upload``)."""

    spec: dict[str, str]
    key: str
    fd: int
    writer: ObjectWriter
    stop: threading.Event = field(default_factory=threading.Event)


class ResultSinks:
    def __init__(self, store: ObjectStore, handoff_root: Path) -> None:
        self.store = store
        self.handoff_root = handoff_root
        self._handoff_dir: Path | None = None

    def open(self, job_id: uuid.UUID, attempt: int) -> JobSinks:
        """Files for the engine to leave the result of ``job_id``'s ``attempt`` in."""
        directory = self._handoff()
        specs = {
            name: {"kind": "handoff", "path": str(directory / f"{job_id}-{attempt}-{file}")}
            for name, file in OBJECTS.items()
        }
        keys = {name: result_key(job_id, file, attempt) for name, file in OBJECTS.items()}
        return JobSinks(specs, keys)

    def commit(self, sinks: JobSinks, written: dict[str, int]) -> StoredResult:
        """Upload the objects the engine reported writing (name -> size) from their handoff files, hashing what
        is uploaded; raises :class:`ResultNotWritten` when a file does not hold what was reported. A blocking call."""
        if "torch" not in written:
            raise ResultNotWritten("the engine reported no saves.pt")
        if unknown := set(written) - set(sinks.specs):
            raise ResultNotWritten(f"the engine reported {len(unknown)} object(s) it was given no sink for")
        digests = {
            name: self._upload_file(sinks.specs[name]["path"], sinks.keys[name], size, name)
            for name, size in written.items()
        }
        self.discard(sinks)
        fmt = TORCH_AND_SAFETENSORS_FORMAT if "safetensors" in digests else TORCH_FORMAT
        torch = digests["torch"]
        return StoredResult(sinks.keys["torch"], torch.size, fmt, torch.sha256, digests.get("safetensors"))

    def discard(self, sinks: JobSinks) -> None:
        """Remove what an attempt left in the handoff directory."""
        for spec in sinks.specs.values():
            Path(spec["path"]).unlink(missing_ok=True)

    def _upload_file(self, path: str, key: str, size: int, name: str) -> Digest:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the engine may have made it a link
        except OSError as error:
            raise ResultNotWritten(f"{name} was not handed off: {error.strerror}") from None
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise ResultNotWritten(f"{name} handed off with {info.st_size} bytes, reported {size}")
            writer = self.store.open_writer(key, size_hint=size)
            try:
                while piece := file.read(CHUNK):
                    writer.write(piece)
                if writer.size != size:
                    raise ResultNotWritten(f"{name} changed while it was read: {writer.size} bytes, reported {size}")
                return writer.commit()
            except BaseException:
                writer.abort()
                raise

    def open_shard(self, key: str, name: str, max_bytes: int) -> ShardSink:
        """A pipe named ``name`` (unique to the attempt) for a shard of at most ``max_bytes`` bytes, to end up at
        ``key``; then run :meth:`upload_shard` (in a thread) while the engine writes. A blocking call."""
        path = self._handoff() / name
        os.mkfifo(path, 0o600)
        if (account := isolation.engine_user() if os.geteuid() == 0 else None) is not None:
            os.chown(path, account.uid, account.gid)  # the engine writes it after dropping to the engine user
        # Opened now, before the engine learns its name: this end is the worker's whatever the engine does to
        # the name, and non-blocking, so that a read waits in poll(), where an abandoned chunk can stop it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # over /proc/sys/fs/pipe-max-size: the default buffer does
            pass
        return ShardSink({"kind": "pipe", "path": str(path)}, key, fd, self.store.open_writer(key, size_hint=max_bytes))

    def upload_shard(self, sink: ShardSink) -> None:
        """Read the pipe until the engine closes it, uploading the bytes as parts fill (nothing is committed yet).
        Returns early when :meth:`discard_shard` stops it. A blocking call: run it in a thread."""
        poller = select.poll()
        poller.register(sink.fd, select.POLLIN | select.POLLHUP)
        while not sink.stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            try:
                piece = os.read(sink.fd, PIPE_BYTES)
            except BlockingIOError:
                continue
            if not piece:
                return  # every writer closed it: the end of the shard
            sink.writer.write(piece)

    def commit_shard(self, sink: ShardSink, size: int) -> Digest:
        """Store the shard the engine reported writing (``size`` bytes) once :meth:`upload_shard` has read it all;
        its size and sha256 as uploaded. Raises :class:`ResultNotWritten` when what arrived differs. Blocking."""
        try:
            if sink.writer.size != size:
                raise ResultNotWritten(f"the shard arrived with {sink.writer.size} bytes, reported {size}")
            digest = sink.writer.commit()
        except BaseException:
            self.discard_shard(sink)
            raise
        self._close(sink)
        return digest

    def discard_shard(self, sink: ShardSink) -> None:
        """Drop what an abandoned attempt wrote: stop its upload and abort it (nothing appears at the key)."""
        sink.stop.set()
        sink.writer.abort()
        self._close(sink)

    @staticmethod
    def _close(sink: ShardSink) -> None:
        if sink.fd >= 0:
            os.close(sink.fd)
            sink.fd = -1
        Path(sink.spec["path"]).unlink(missing_ok=True)

    def _handoff(self) -> Path:
        if self._handoff_dir is None:
            # The engine writes here. A root worker's engine runs as the engine user (nnqueue.isolation),
            # which may not reach the store's folder: its handoff directory is then in the temp folder (1777).
            parent = None if os.geteuid() == 0 else self.handoff_root
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            self._handoff_dir = isolation.engine_writable_dir("nnqueue-handoff-", parent=parent)
        return self._handoff_dir
