"""The asyncio loop that owns a worker's engine for the whole life of the process.

vLLM's ``AsyncLLM`` binds to the event loop it first runs on (a second ``asyncio.run()`` on the same
engine hangs), so one loop, in its own thread, builds the engine and runs every job on it. Celery's
task threads hand jobs to that loop with :meth:`EngineHost.call` and block until their job is done;
the loop runs up to ``max_concurrent_jobs`` jobs at once, and vLLM batches their requests together.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class EngineHost:
    def __init__(self, blocking_threads: int = 8) -> None:
        self.loop = asyncio.new_event_loop()
        # Jobs do their database and object-store I/O in threads (asyncio.to_thread); the default
        # pool (cores + 4) would make concurrent jobs queue for it on small machines.
        self.loop.set_default_executor(ThreadPoolExecutor(blocking_threads, thread_name_prefix="nnqueue-io"))
        self._thread = threading.Thread(target=self.loop.run_forever, name="nnqueue-engine-loop", daemon=True)
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the engine loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        """Cancel what still runs on the loop, let it finish cancelling, then stop the loop.

        The engine's shutdown only *schedules* the cancellation of its output tasks; a loop stopped
        before they run leaves a socket open that hangs the interpreter at exit.
        """
        self.call(_cancel_pending())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


async def _cancel_pending() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
