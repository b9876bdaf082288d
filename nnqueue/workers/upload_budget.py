"""The bytes of harvest shards that a worker has handed off and not yet stored: a bound that holds the engine back
only when the uploads fall behind.

A chunk's bulk slot is freed as soon as the engine has written its shard (:mod:`nnqueue.workers.chunk_execution`):
the upload into the store goes on beside the next chunks, so the engine never waits for the store while the store
keeps up. Without a bound, an engine faster than the store would pile shards up in the handoff folder (on disk, or
in memory on a tmpfs) without end. With one, a chunk whose shard does not fit waits for room still holding its
slot, so the engine gets no new chunk meanwhile (back pressure) and runs at the store's pace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class UploadBudget:
    """At most ``limit`` bytes held at once, granted first come first served. Use it on one event loop."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"an upload budget needs at least one byte, not {limit}")
        self.limit = limit
        self.held = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @contextlib.asynccontextmanager
    async def room(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` for the block, once they fit beside what is held (a shard larger than the whole budget
        waits until nothing else is held, then goes alone). Those who asked earlier are served first."""
        await self._acquire(nbytes)
        try:
            yield
        finally:
            self.held -= nbytes
            self._grant()

    def _fits(self, nbytes: int) -> bool:
        return self.held == 0 or self.held + nbytes <= self.limit

    async def _acquire(self, nbytes: int) -> None:
        if not self._waiting and self._fits(nbytes):
            self.held += nbytes
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (nbytes, granted)
        self._waiting.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted just before the cancel: give it back
                self.held -= nbytes
            elif entry in self._waiting:  # (a grant that found it cancelled has dropped it already)
                self._waiting.remove(entry)
            self._grant()
            raise

    def _grant(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            nbytes, granted = self._waiting.popleft()
            if not granted.done():
                self.held += nbytes
                granted.set_result(None)
