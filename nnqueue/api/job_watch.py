"""Following jobs from the API's event loop: one poller per API process for every job someone waits on.

nnsight's blocking clients hold a websocket (``remote=True``) or an HTTP request (``serve=``) open until their
job ends. Each waiter registers its job here (:meth:`JobWatcher.watching`); one task reads all registered
jobs in a single query every ``poll_s`` (in a thread, so the loop never blocks on the database), with their
queue positions and whether a live worker still serves their model, and wakes every waiter. The database is
the only shared state, so this works whichever API process accepted the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import Job
from nnqueue.scheduler.positions import queue_positions
from nnqueue.scheduler.registry import LiveModels

log = logging.getLogger(__name__)
POLL_S = 0.25


@dataclass(frozen=True)
class Seen:
    """A watched job as last read: the row (detached), its queue place, and whether its model has a live worker."""

    job: Job
    position: int | None
    model_live: bool


class JobWatcher:
    def __init__(
        self, sessions: sessionmaker[Session], stale_after_s: float, poll_s: float = POLL_S, always: Iterable[str] = ()
    ) -> None:
        """``always``: models served whether or not a worker runs (scaled to zero): their jobs are never orphans."""
        self.sessions, self.stale_after_s, self.poll_s = sessions, stale_after_s, poll_s
        self.always = tuple(always)
        self._watched: Counter[uuid.UUID] = Counter()
        self._seen: dict[uuid.UUID, Seen] = {}
        self._tick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start polling on the running loop (the API's lifespan does)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="nnqueue-job-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def watching(self, job_id: uuid.UUID) -> Iterator[None]:
        self._watched[job_id] += 1
        try:
            yield
        finally:
            self._watched[job_id] -= 1
            if self._watched[job_id] <= 0:
                del self._watched[job_id]
                self._seen.pop(job_id, None)

    def seen(self, job_id: uuid.UUID) -> Seen | None:
        """The job as of the last poll; None until it exists (or before the first poll)."""
        return self._seen.get(job_id)

    async def next_poll(self) -> None:
        """Return after the next poll."""
        await self._tick.wait()

    async def _run(self) -> None:
        while True:
            watched = list(self._watched)
            if watched:
                try:
                    self._seen.update(await asyncio.to_thread(self._read, watched))
                except Exception:  # a database blip: the waiters see the last state and the next poll retries
                    log.exception("reading watched jobs failed")
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()
            await asyncio.sleep(self.poll_s)

    def _read(self, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, Seen]:
        with self.sessions() as session:
            jobs = list(session.scalars(select(Job).where(Job.id.in_(job_ids))))
            if not jobs:
                return {}
            positions = queue_positions(session, jobs)
            live = LiveModels(self.stale_after_s, max_age_s=0, always=self.always).read(session)  # no grace
        return {job.id: Seen(job, positions.get(job.id), job.model_key in live) for job in jobs}
