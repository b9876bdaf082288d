"""The weights a worker's engine serves: their version, the gate that keeps every request off an update, and
checkpoint swaps applied while the worker runs.

**Versions.** A worker starts on its checkpoint's version, ``base-<digest>``: the sha256 of the checkpoint's
identity (:func:`checkpoint_identity`: a Hub repository and revision, or a local folder's path and the names and
sizes of its files; cheap, no file is read). Each update gives a new version with its source: a checkpoint swap
the version of its :class:`~nnqueue.db.models.WeightsUpdate` row (``u<id>-<digest>``), a trainer's push over
NCCL (:mod:`nnqueue.workers.trl_server`) ``trl-<random>``. The worker reports its version in its registry row
(at registration and after each update: :func:`nnqueue.scheduler.registry.set_weights`); every job and harvest
chunk records the version it ran on.

**No request runs across an update** (:class:`WeightsGate`, on the engine loop). Every job and chunk runs while
holding the gate's shared side (:meth:`WeightsGate.serving`), which also tells it the version; an update takes
its exclusive side (:meth:`WeightsGate.paused`): new holders wait from that moment, the update waits for the
holders already in to finish, loads, bumps the version and lets the waiting ones in. The pause (from the update's
request to the resume) is logged and kept (:attr:`WeightsGate.pauses`). A job pinned to a version that it finds
gone once inside the gate is handed back to the queue (:class:`WrongWeights`), where only a worker serving its
pin claims it.

**Checkpoint swaps** (:class:`CheckpointUpdater`). The database is the signal, as for a cancel: the heartbeat
thread looks for the model's updates newer than the last one applied (:func:`nnqueue.scheduler.weights.updates_after`)
and starts their application on the engine loop. An ``s3://`` checkpoint is downloaded by this process into a
folder the engine user can read (the engine holds no store credentials); a path is read by the engine itself, from
that folder too (hard-linked or copied) when the engine sees only its own filesystem view.
The load is nnqueue's RPC ``nnqueue_load_weights`` (:mod:`nnqueue.enginecore.rpc`), which feeds the tensors to
vLLM's own loader, each rank its shard, and then refreshes the weights guard's reference copy. A load that fails
is put back from the guard's copy (the worker stays on its version and records the error in its row); without a
guard the weights may be half-loaded, so the worker stops and its supervisor starts a fresh one, which replays
the updates. A worker that starts later replays all of the model's updates, in order, before it registers
(:meth:`CheckpointUpdater.catch_up`), so it serves the newest version and never an older one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import WeightsUpdate
from nnqueue.errors import NNqueueError
from nnqueue.scheduler import registry
from nnqueue.scheduler.weights import store_key, updates_after
from nnqueue.storage.object_store import ObjectStore

log = logging.getLogger(__name__)
_PIECE = 8 << 20


def checkpoint_identity(model: str, revision: str | None) -> dict[str, Any]:
    """What names the checkpoint a worker loads: a local folder's path and its files' names and sizes (hidden
    files left out), or a Hub repository id and the revision asked for."""
    path = Path(model)
    if not path.is_dir():
        return {"repository": model, "revision": revision}
    files = sorted(
        (file.relative_to(path).as_posix(), file.stat().st_size)
        for file in path.rglob("*")
        if file.is_file() and not any(part.startswith(".") for part in file.relative_to(path).parts)
    )
    return {"path": str(path.resolve()), "files": files}


def base_version(model: str, revision: str | None) -> tuple[str, dict[str, Any]]:
    """The version a worker starts on, and its source (``{"source": "checkpoint", "identity": ...}``)."""
    identity = checkpoint_identity(model, revision)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return f"base-{digest}", {"source": "checkpoint", "identity": identity}


class WrongWeights(NNqueueError):
    """A pinned job or chunk reached an engine that no longer serves its version (an update came first)."""


@dataclass
class WeightsGate:
    """The engine's weights version, and the gate between requests and updates (see the module doc). Use on the
    engine loop only."""

    version: str
    source: dict[str, Any]
    pauses: list[float] = field(default_factory=list)  # seconds each update kept new requests waiting
    _running: int = 0
    _paused: bool = False
    _changed: asyncio.Condition | None = None

    @property
    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the engine loop, where it is used
            self._changed = asyncio.Condition()
        return self._changed

    @asynccontextmanager
    async def serving(self, pin: str | None = None) -> AsyncIterator[str]:
        """Hold the weights still while a request runs; yields the version. :class:`WrongWeights` when ``pin``
        is not the version served once inside."""
        async with self._condition:
            await self._condition.wait_for(lambda: not self._paused)
            if pin is not None and pin != self.version:
                raise WrongWeights(f"pinned to weights version {pin!r}; this engine now serves {self.version!r}")
            self._running += 1
        try:
            yield self.version
        finally:
            async with self._condition:
                self._running -= 1
                self._condition.notify_all()

    async def pause(self) -> float:
        """Stop new requests and wait for those running to finish; returns when that began (loop time)."""
        began = asyncio.get_running_loop().time()
        async with self._condition:
            await self._condition.wait_for(lambda: not self._paused)
            self._paused = True
            await self._condition.wait_for(lambda: self._running == 0)
        log.info("weights update: requests drained in %.3f s", asyncio.get_running_loop().time() - began)
        return began

    async def resume(self, began: float, version: str | None = None, source: dict[str, Any] | None = None) -> None:
        """Let requests in again, on ``version`` (None: the weights did not change)."""
        if version is not None:
            self.version, self.source = version, source or {}
        pause = asyncio.get_running_loop().time() - began
        self.pauses.append(pause)
        log.info("weights update: serving %s again after a pause of %.3f s", self.version, pause)
        async with self._condition:
            self._paused = False
            self._condition.notify_all()

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[dict[str, Any]]:
        """Pause for an update; set ``version`` (and ``source``) in the yielded dict to bump the version."""
        began = await self.pause()
        bump: dict[str, Any] = {}
        try:
            yield bump
        finally:
            await self.resume(began, bump.get("version"), bump.get("source"))


class UpdateFailed(NNqueueError):
    """A checkpoint could not be loaded; ``restored``: the weights were put back (the version stands)."""

    def __init__(self, message: str, restored: bool) -> None:
        super().__init__(message)
        self.restored = restored


async def load_checkpoint(llm: Any, files: list[str], tensors: list[str] | None) -> int:
    """Load the safetensors ``files`` (every tensor, or the named ``tensors``) into the engine's weights through
    nnqueue's RPC on every rank; returns the number of tensors loaded. Call while the gate is paused."""
    answers = await llm.collective_rpc("nnqueue_load_weights", args=(files, tensors))
    errors = [answer for answer in answers if isinstance(answer, dict) and answer.get("error")]
    if errors:
        raise UpdateFailed(str(errors[0]["error"]), restored=all(bool(answer.get("restored")) for answer in errors))
    await llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
    return int(next((answer["loaded"] for answer in answers if isinstance(answer, dict)), 0))


@dataclass
class CheckpointUpdater:
    """Applies the model's checkpoint swaps to this worker's engine (see the module doc)."""

    sessions: sessionmaker[Session]
    store: ObjectStore
    llm: Any  # the worker's AsyncLLM
    gate: WeightsGate
    model_key: str
    worker_id: str
    folder: Path  # where downloaded checkpoints wait for the engine (readable by the engine user)
    # The engine sees its own filesystem view (nnqueue.mountns), which holds ``folder`` but not the host's other
    # paths: a local checkpoint is hard-linked (or copied) into ``folder`` first.
    staged: bool = False
    # Called when a failed load left the weights changed and not restorable (default: none; the worker stops).
    broken: Callable[[], None] = field(default=lambda: None)
    applied: int = 0  # the id of the last update applied
    _task: asyncio.Future[None] | None = None

    def poll(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start applying the model's new updates on ``loop``, unless that is under way (heartbeat thread)."""
        if self._task is not None and not self._task.done():
            return
        with self.sessions() as session:
            pending = updates_after(session, self.model_key, self.applied)
        if pending:
            self._task = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.apply(pending), loop), loop=loop)

    async def catch_up(self) -> None:
        """Apply every update of the model, in order (a worker starting after them; before it registers)."""
        pending = await asyncio.to_thread(self._pending)
        if pending:
            log.info("replaying %d weights update(s) of %s before serving", len(pending), self.model_key)
            await self.apply(pending, report=False)

    async def replay_onto(self, llm: Any, base: tuple[str, dict[str, Any]]) -> None:
        """A fresh engine (``llm``, an ``AsyncLLM``) replaced this worker's dead one and serves the checkpoint
        (``base``: its version and source): apply every update of the model to it, as a worker starting after them
        does, and say in the worker's row which version it serves."""
        if self._task is not None:  # an update that was under way on the dead engine ends first (it failed there)
            await asyncio.gather(self._task, return_exceptions=True)
        self.llm, self.applied = llm, 0
        self.gate.version, self.gate.source = base
        self._task = asyncio.ensure_future(self.catch_up())  # the heartbeat's poll starts nothing meanwhile
        await self._task
        await asyncio.to_thread(self._report, self.gate.version, self.gate.source)

    def _pending(self) -> list[WeightsUpdate]:
        with self.sessions() as session:
            return updates_after(session, self.model_key, self.applied)

    async def apply(self, updates: list[WeightsUpdate], report: bool = True) -> None:
        for update in updates:
            source = {"source": update.source, "update_id": update.id, "tensors": update.tensors}
            try:
                files, downloaded = await asyncio.to_thread(self._fetch, update)
                try:
                    async with self.gate.paused() as bump:
                        started = time.monotonic()
                        loaded = await load_checkpoint(self.llm, files, update.tensors)
                        bump.update(version=update.version, source=source)
                    log.info(
                        "weights update %d (%s): %d tensors from %s loaded in %.3f s",
                        update.id,
                        update.version,
                        loaded,
                        update.source,
                        time.monotonic() - started,
                    )
                finally:
                    if downloaded is not None:
                        shutil.rmtree(downloaded, ignore_errors=True)
            except Exception as error:  # noqa: BLE001 - recorded on the worker's row; the worker goes on serving
                restored = not isinstance(error, UpdateFailed) or error.restored
                log.error("weights update %d from %s failed: %s", update.id, update.source, error)
                failed = {**self.gate.source, "error": f"update {update.version} ({update.source}) failed: {error}"}
                self.applied = update.id  # not tried again: a new update is asked for with a new row
                if report:
                    await asyncio.to_thread(self._report, self.gate.version, failed)
                if not restored:
                    log.critical("the failed load left the weights changed and no copy to restore: stopping")
                    self.broken()
                    return
                continue
            self.applied = update.id
            if report:
                await asyncio.to_thread(self._report, update.version, source)

    def _report(self, version: str, source: dict[str, Any]) -> None:
        registry.set_weights(self.sessions, self.worker_id, version, source)

    def _fetch(self, update: WeightsUpdate) -> tuple[list[str], Path | None]:
        """The checkpoint's files as the engine reads them, and the folder to delete after (a download)."""
        key = store_key(update.source)
        if key is None:
            path = Path(update.source)
            files = sorted(str(file) for file in path.glob("*.safetensors")) if path.is_dir() else [str(path)]
            if not files or not all(Path(file).is_file() for file in files):
                raise UpdateFailed(f"no safetensors checkpoint at {update.source!r} on this worker's host", True)
            if not self.staged:
                return files, None
        folder = self.folder / f"update-{update.id}"
        folder.mkdir(mode=0o755, exist_ok=True)
        if key is None:
            return [str(_staged(Path(file), folder)) for file in files], folder
        target = folder / "checkpoint.safetensors"
        with self.store.open_stream(key) as source, open(target, "wb") as out:
            while piece := source.read(_PIECE):
                out.write(piece)
        os.chmod(target, 0o644)
        return [str(target)], folder


def _staged(file: Path, folder: Path) -> Path:
    """``file`` in ``folder``: a hard link where the engine user may read the file itself (same file system: no
    copy), else a copy it may read (a hard link keeps the file's mode: a checkpoint saved 0600, as transformers'
    ``save_pretrained`` saves one, was unreadable to the engine, which failed the update)."""
    target = folder / file.name
    if file.stat().st_mode & stat.S_IROTH:
        try:
            os.link(file, target)
            return target
        except OSError:
            pass  # another file system: copied
    shutil.copyfile(file, target)
    os.chmod(target, 0o644)
    return target
