"""Group commit for the worker's database calls: the calls that arrive while one is in flight go together.

With hundreds of one-prompt jobs in flight, each job's claim and finish were their own transaction in their
own thread: a pool checkout, a ping, BEGIN, three or four statements through the ORM, COMMIT, and two thread
hops, every one of them Python under the GIL that the engine loop shares. On the H100 that Python, not the GPU,
bounded one-prompt trace jobs (SQLAlchemy was half of the worker's GIL samples). A :class:`GroupedCalls` runs
one blocking call at a time, in a thread, on every item that arrived since the previous call began: one
call when the worker is quiet (no added latency: the first item goes at once), few and large under load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupedCalls(Generic[T, R]):
    """``await calls(item)`` runs ``run(items)`` in a thread for a group of items, this one among them.

    ``run`` returns one result per item, in order, or an exception instance for an item of its own that
    failed (raised to that item's caller); an exception ``run`` raises goes to every caller of the group. A
    caller cancelled before its group starts is left out of it; one cancelled later is not (its item's work
    is done, its result dropped), as with :func:`asyncio.to_thread`. Use from one event loop."""

    def __init__(self, run: Callable[[list[T]], Sequence[R | BaseException]]) -> None:
        self._run = run
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run_groups())
        return await future

    async def _run_groups(self) -> None:
        while self._waiting:
            group = [(item, future) for item, future in self._waiting if not future.done()]
            self._waiting = []
            if not group:
                continue
            try:
                results: Sequence[R | BaseException] = await asyncio.to_thread(self._run, [item for item, _ in group])
            except asyncio.CancelledError:  # the loop is closing: nobody waits forever
                for _, future in group + self._waiting:
                    future.cancel()
                raise
            except Exception as error:  # noqa: BLE001 - it is each caller's, raised to each of them
                results = [error] * len(group)
            for (_, future), result in zip(group, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
