"""The worker's side of sinks: where the engine leaves a job's result or a harvest chunk's shard, and the
upload of what it left, which this process does itself.

The engine process runs users' code, holds no store credentials and has no network
(:mod:`nnqueue.enginecore.sink`, :mod:`nnqueue.netns`). It writes results and shards to files in a private
handoff directory, hashing them as it writes, and reports each file's size and sha256; this worker checks the
file it finds there (opened without following a link, a regular file with one link, the reported size, owned
by the engine's user or this worker's: never a file of someone else's that the engine linked there), then
streams it from that open file to the store (:meth:`nnqueue.storage.object_store.ObjectStore.put_stream`: an S3
multipart upload for large objects, its parts read from the file at their offsets and sent in parallel; a local
store copies it in the kernel) and records the size and the engine's sha256 with the job or chunk, which the API
hands to clients and the clients check (:mod:`nnqueue.workers.job_execution`, :mod:`nnqueue.scheduler.harvest_manifest`). Nothing the
engine holds reaches the store: no URL, no credential; so an engine that a trace took over can forge the
results of the steps it runs (and report a sha256 that does not match them, which the clients' check then
refuses), but cannot replace a committed one, and a change made to a stored object behind the worker's back
no longer matches its recorded sha256.

A handoff file is read once, by the upload, and removed. A harvest shard's upload may begin while the engine still
writes it (`ShardFollower`: the parts its staging file holds whole go up at once, the rest after the report),
with the same checks of the file and the same record. Results are per attempt
(``results/<job>/<attempt>/...``), so a worker that lost its job cannot overwrite the new holder's result;
a shard's key is its chunk's (a re-run writes the same bytes), and a worker that lost its chunk removes its
file instead of uploading it. A shard larger than the bound its chunk allows is refused (`open_shard`).

The handoff folder is one of the two host folders the engine can write, so an engine that escaped its sandbox could
fill the host's disk there (a seventh red-team round's finding). The worker knows every name it handed out there and
the bound of each, so the folder may hold no more than their sum: `ResultSinks.overrun` compares the two, and the
worker's watchdog (:mod:`nnqueue.workers.engine_folders`) acts on a folder that holds more. A stopping worker removes
the folder (`ResultSinks.close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import shutil
import stat
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

from nnqueue import isolation
from nnqueue.enginecore.sink import staging_path
from nnqueue.errors import NNqueueError
from nnqueue.storage.keys import SAFETENSORS_FILE, TORCH_FILE, result_key
from nnqueue.storage.object_store import Digest, FileUpload, ObjectStore
from nnqueue.storage.results import TORCH_AND_SAFETENSORS_FORMAT, TORCH_FORMAT, StoredResult
from nnqueue.workers.engine_folders import folder_usage, usage_overrun

# The result's objects, by the names the engine reports them under.
OBJECTS = {"torch": TORCH_FILE, "safetensors": SAFETENSORS_FILE}
# How often a shard being written is looked at (`ShardFollower.poll`), on the engine loop.
FOLLOW_INTERVAL_S = 0.01
# What the handoff folder may take on the disk beyond the bounds of the files handed out (`ResultSinks.overrun`): this
# much for each (a file's last blocks, a staging file's beside it), and as much again for the folder.
HANDOFF_SLACK_BYTES = 1 << 20
# The entries the handoff folder may hold: this many for each file handed out (it, its staging file) and a few more.
ENTRIES_PER_FILE = 4
SPARE_ENTRIES = 64
T = TypeVar("T")


class ResultTooLarge(NNqueueError):
    """A job's result is larger than the worker takes (``NNQUEUE_MAX_RESULT_BYTES``); nothing was stored."""


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
    def __init__(
        self,
        store: ObjectStore,
        handoff_root: Path,
        handoff_parent: Path | None = None,
        max_result_bytes: int | None = None,
    ) -> None:
        """The handoff directory is made in ``handoff_parent`` when given (``NNQUEUE_WORKER_HANDOFF_DIR``), else in
        ``handoff_root``, or in the temp folder when this process is root. ``max_result_bytes``: a job's result
        objects larger than this are refused (`commit`); None: no limit."""
        self.store = store
        self.max_result_bytes = max_result_bytes
        self.handoff_root = handoff_root
        self.handoff_parent = handoff_parent
        self._handoff_dir: Path | None = None
        # The handoff paths handed out and not yet discarded, each with its bound (None: unbounded), for `overrun`.
        self._handed_out: dict[str, int | None] = {}
        # The paths are handed out on the engine loop and on I/O threads, and read by the watchdog's thread.
        self._lock = threading.Lock()
        self._closed = False

    def open(self, job_id: uuid.UUID, attempt: int, *, safetensors: bool, part: str = "") -> JobSinks:
        """Files for the engine to leave the result of ``job_id``'s ``attempt`` in: ``saves.pt``, and with
        ``safetensors`` a sink the engine fills when every saved value is a tensor. ``part``: the result of one of
        the job's traces (a session's), read back (`read_back`) rather than stored."""
        directory = self.handoff_dir()
        objects = {name: file for name, file in OBJECTS.items() if safetensors or name != "safetensors"}
        # A name of the worker's choosing that no engine can guess: one that knew it could plant a folder there first.
        token = secrets.token_hex(8)
        prefix = f"{job_id}-{attempt}-{part}-{token}-" if part else f"{job_id}-{attempt}-{token}-"
        specs = {
            name: {"kind": "handoff", "path": str(directory / f"{prefix}{file}")} for name, file in objects.items()
        }
        keys = {name: result_key(job_id, file, attempt) for name, file in objects.items()}
        self._hand_out([spec["path"] for spec in specs.values()], self.max_result_bytes)
        return JobSinks(specs, keys)

    @contextlib.asynccontextmanager
    async def staged_result(
        self, job_id: uuid.UUID, attempt: int, *, safetensors: bool, part: str = ""
    ) -> AsyncIterator[JobSinks]:
        """`open` for an async executor: what the attempt left in the handoff directory is removed on leaving,
        whether its result was committed (`commit`), there was none, or the attempt failed. Both on the calling
        loop: naming the files (the directory is made once) and unlinking what is left (usually nothing: `commit`
        removed it) cost less than the two thread hops they took, which hundreds of jobs in flight queued behind
        each other's uploads (issue 36)."""
        sinks = self.open(job_id, attempt, safetensors=safetensors, part=part)
        try:
            yield sinks
        finally:
            self.discard(sinks)

    def commit(self, sinks: JobSinks, written: Mapping[str, Reported]) -> StoredResult:
        """Upload the objects the engine reported writing (name -> size and sha256) from their handoff files;
        raises :class:`ResultNotWritten` when a file does not hold what was reported, and :class:`ResultTooLarge`,
        uploading nothing, when an object is larger than ``max_result_bytes``. A blocking call."""
        if "torch" not in written:
            raise ResultNotWritten("the engine reported no saves.pt")
        if unknown := set(written) - set(sinks.specs):
            raise ResultNotWritten(f"the engine reported {len(unknown)} object(s) it was given no sink for")
        largest = max(reported.size for reported in written.values())
        if self.max_result_bytes is not None and largest > self.max_result_bytes:
            raise ResultTooLarge(
                f"the job's result has {largest} bytes, over this deployment's limit of {self.max_result_bytes} bytes"
                " per job (NNQUEUE_MAX_RESULT_BYTES): save fewer or smaller values"
            )
        digests = {
            name: self._upload(sinks.specs[name]["path"], sinks.keys[name], reported, name)
            for name, reported in written.items()
        }
        self.discard(sinks)
        fmt = TORCH_AND_SAFETENSORS_FORMAT if "safetensors" in digests else TORCH_FORMAT
        torch = digests["torch"]
        return StoredResult(sinks.keys["torch"], torch.size, fmt, torch.sha256, digests.get("safetensors"))

    def read_back(self, sinks: JobSinks, written: Mapping[str, Reported]) -> bytes:
        """The ``saves.pt`` the engine reported writing, read from its handoff file with the checks of `commit`
        (its sha256 too) and the same bound, then removed: a session's trace's saves, for the session's builder. A
        blocking call."""
        reported = written.get("torch")
        if reported is None:
            raise ResultNotWritten("the engine reported no saves.pt")
        if self.max_result_bytes is not None and reported.size > self.max_result_bytes:
            raise ResultTooLarge(
                f"a trace's result has {reported.size} bytes, over this deployment's limit of"
                f" {self.max_result_bytes} bytes per job (NNQUEUE_MAX_RESULT_BYTES): save fewer or smaller values"
            )
        try:
            with self._open_handed_off(sinks.specs["torch"]["path"], "saves.pt") as file:
                self._check_size(file, reported, "saves.pt")
                data = file.read(reported.size + 1)
        finally:
            self.discard(sinks)
        if len(data) != reported.size or hashlib.sha256(data).hexdigest() != reported.sha256:
            raise ResultNotWritten("saves.pt changed while it was read")
        return data

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
        """Remove what an attempt left in the handoff directory, a staging file included (a session's builder killed
        while it wrote the result)."""
        for spec in sinks.specs.values():
            remove(spec["path"])
            remove(staging_path(spec["path"]))
        self._take_back([spec["path"] for spec in sinks.specs.values()])

    def open_shard(self, key: str, name: str, max_bytes: int) -> ShardSink:
        """A handoff file named ``name`` (unique to the attempt) for a shard of at most ``max_bytes`` bytes, to end
        up at ``key`` (`commit_shard`)."""
        name = f"{secrets.token_hex(8)}-{name}"  # unguessable, as `open`'s names
        path = str(self.handoff_dir() / name)
        self._hand_out([path], max_bytes)
        return ShardSink({"kind": "handoff", "path": path}, key, max_bytes)

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
        """Drop what an abandoned attempt wrote (nothing appears at the key), its staging file too."""
        remove(sink.spec["path"])
        remove(staging_path(sink.spec["path"]))
        self._take_back([sink.spec["path"]])

    @contextlib.asynccontextmanager
    async def following(self, sink: ShardSink) -> AsyncIterator[ShardFollower]:
        """The shard's upload while the engine writes it (`ShardFollower`), committed with `ShardFollower.commit`
        instead of `commit_shard`; what was sent is dropped on leaving unless it was committed."""
        follower = ShardFollower(self, sink)
        try:
            yield follower
        finally:
            await asyncio.to_thread(follower.abort)

    def _upload(self, path: str, key: str, reported: Reported, name: str) -> Digest:
        """Stream the handoff file at ``path`` to ``key`` once it is checked against ``reported`` (see the module
        doc); its size and the engine's sha256."""
        with self._open_handed_off(path, name) as file:
            self._check_size(file, reported, name)
            uploaded = self.store.put_stream(key, file, size_hint=reported.size)
        if uploaded != reported.size:
            self.store.delete(key)
            raise ResultNotWritten(f"{name} changed while it was read: {uploaded} bytes, reported {reported.size}")
        return Digest(uploaded, reported.sha256)

    def _open_handed_off(self, path: str, name: str) -> BinaryIO:
        """The file at ``path`` opened for reading if it is one the engine handed off: not a link (nor a FIFO that
        would block the open), a regular file with one link, the engine's or this worker's."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            raise ResultNotWritten(f"{name} was not handed off: {error.strerror}") from None
        file = os.fdopen(fd, "rb")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid not in self._owners():
            file.close()
            raise ResultNotWritten(f"{name} was not handed off as a file of the engine's own")
        return file

    def _check_size(self, file: BinaryIO, reported: Reported, name: str) -> None:
        """The open handoff file still has one link and holds the ``reported`` size."""
        info = os.fstat(file.fileno())
        if info.st_nlink != 1:
            raise ResultNotWritten(f"{name} was not handed off as a file of the engine's own")
        if info.st_size != reported.size:
            raise ResultNotWritten(f"{name} handed off with {info.st_size} bytes, reported {reported.size}")

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

    def handoff_dir(self) -> Path:
        """The folder the engine leaves files in, made on first use (the worker makes it before the engine
        starts: it is one of the few the engine's filesystem view lets it write, :mod:`nnqueue.mountns`)."""
        if self._handoff_dir is None:
            # The engine writes here. A root worker's engine runs as the engine user (nnqueue.isolation),
            # which may not reach the store's folder: its handoff directory is then in the temp folder (1777).
            parent = self.handoff_parent or (None if os.geteuid() == 0 else self.handoff_root)
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            self._handoff_dir = isolation.engine_writable_dir("nnqueue-handoff-", parent=parent)
        return self._handoff_dir

    def overrun(self) -> str | None:
        """Why the handoff folder holds more than this worker handed out room for, or None: more bytes on the disk
        than the bounds of the paths handed out and not yet discarded (each with its staging file, plus
        :data:`HANDOFF_SLACK_BYTES` each and once more; unchecked while a path is unbounded, ``max_result_bytes``
        None), more entries than :data:`ENTRIES_PER_FILE` per path and :data:`SPARE_ENTRIES`, or a folder, whose
        content one scan cannot see (the worker hands out files only). A name the worker did not hand out counts
        toward the bytes but is no fault of itself (an engine's staging file may precede its path's handing out).
        One scan of the folder, never of what is in it; None before the folder is made and once it is closed."""
        if self._handoff_dir is None:
            return None
        bounds = self._bounds()
        most = ENTRIES_PER_FILE * len(bounds) + SPARE_ENTRIES
        try:
            usage = folder_usage(self._handoff_dir, most)
        except OSError as error:
            return None if self._closed else f"the handoff folder {self._handoff_dir} could not be read: {error}"
        # With the paths handed out meanwhile: the scan may have seen their files. Those discarded meanwhile stay in.
        bounds.update(self._bounds())
        context = f" ({len(bounds)} paths handed out)"
        return usage_overrun("handoff folder", usage, most, handoff_room(bounds.values()), context)

    def room(self) -> int | None:
        """The bytes the handoff folder may take on the disk now (`handoff_room`); None while a path is unbounded."""
        return handoff_room(self._bounds().values())

    @property
    def closed(self) -> bool:
        """Whether the handoff folder was removed (`close`)."""
        return self._closed

    def close(self) -> None:
        """Remove the handoff folder, if this worker made it, with whatever the engine left in it (a link is removed,
        never followed): the worker is stopping, and the folder would otherwise outlive it in the temp folder."""
        with self._lock:
            self._closed = True
        if self._handoff_dir is not None:
            shutil.rmtree(self._handoff_dir, ignore_errors=True)  # refuses a link put in the folder's place

    def _hand_out(self, paths: list[str], bound: int | None) -> None:
        with self._lock:
            self._handed_out.update(dict.fromkeys(paths, bound))

    def _take_back(self, paths: list[str]) -> None:
        with self._lock:
            for path in paths:
                self._handed_out.pop(path, None)

    def _bounds(self) -> dict[str, int | None]:
        with self._lock:
            return dict(self._handed_out)


def handoff_room(bounds: Iterable[int | None]) -> int | None:
    """The bytes the handoff folder may take on the disk with files of these ``bounds`` handed out (see
    `ResultSinks.overrun`); None when one is unbounded."""
    room = HANDOFF_SLACK_BYTES
    for bound in bounds:
        if bound is None:
            return None
        room += bound + HANDOFF_SLACK_BYTES
    return room


def remove(path: str) -> None:
    """Remove what is at ``path`` in the handoff folder, whatever the engine left there: a file, a link (not
    followed) or a folder (a sixth red-team round planted folders at names the worker would use)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)  # refuses a link: the unlink above removed one


class ShardFollower:
    """A shard uploaded while the engine writes it: the engine writes to a staging file beside the handoff path
    (:func:`nnqueue.enginecore.sink.staging_path`) and renames it there when complete. `poll`, called on the engine
    loop every few milliseconds while the chunk runs (`during`), opens that staging file once it exists, checked as
    a handed-off file is, and sends each part that the file holds whole (:meth:`ObjectStore.follow_file`);
    `commit` sends the rest once the engine has reported the shard, and stores it. A staging file never seen (the
    write came and went between polls) or refused is uploaded whole from the handoff path by `commit_shard`."""

    def __init__(self, sinks: ResultSinks, sink: ShardSink) -> None:
        self.sinks, self.sink = sinks, sink
        self.file: BinaryIO | None = None
        self.upload: FileUpload | None = None
        self.refused = False
        self._lock = threading.Lock()  # `commit` on an I/O thread, `abort` from the chunk's end

    async def during(self, work: Awaitable[T]) -> T:
        """Await ``work`` (the chunk on the engine) polling meanwhile."""

        async def poll() -> None:
            while True:
                self.poll()
                await asyncio.sleep(FOLLOW_INTERVAL_S)

        polling = asyncio.ensure_future(poll())
        try:
            return await work
        finally:
            polling.cancel()

    def poll(self) -> None:
        """Non-blocking: the staging file opened once it is there, then the parts it holds whole sent."""
        if self.refused:
            return
        try:
            if self.file is None:
                path = staging_path(self.sink.spec["path"])
                if not os.path.lexists(path):
                    return
                self.file = self.sinks._open_handed_off(path, "the shard")
                self.upload = self.sinks.store.follow_file(self.sink.key, self.file, self.sink.max_bytes)
            assert self.upload is not None
            self.upload.advance(min(os.fstat(self.file.fileno()).st_size, self.sink.max_bytes))
        except (OSError, ResultNotWritten):  # gone meanwhile, or not the engine's own: `commit` uploads it whole
            self.refused = True

    def commit(self, reported: Reported) -> Digest:
        """Store the shard the engine reported writing; its size and sha256 (see `ResultSinks.commit_shard`, whose
        checks this makes). Blocking. The handoff file is removed."""
        with self._lock:
            if self.refused or self.upload is None:
                self._abort()
                return self.sinks.commit_shard(self.sink, reported)
            assert self.file is not None
            try:
                if reported.size > self.sink.max_bytes:
                    raise ResultNotWritten(
                        f"the shard has {reported.size} bytes, over its bound of {self.sink.max_bytes}"
                    )
                self.sinks._check_size(self.file, reported, "the shard")
                stored = self.upload.finish(reported.size)
            except BaseException:
                self._abort()
                raise
            finally:
                self.sinks.discard_shard(self.sink)
            self.upload = None
            self._close()
        return Digest(stored, reported.sha256)

    def abort(self) -> None:
        """Drop what was sent (nothing appears at the key); nothing to do after a commit. Blocking."""
        with self._lock:
            self._abort()

    def _abort(self) -> None:
        if self.upload is not None:
            self.upload.abort()
            self.upload = None
        self._close()

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
