"""The processes of a vLLM engine's core, and waiting for their end once they are killed.

A worker kills its engine core at once where a graceful end would only cost time: when a dead or replaced engine
gives way to a fresh one (:mod:`nnqueue.workers.engine_restart`), and when the worker stops after its jobs drained
(vLLM's grace period, spent by a core with nothing left to do, took ~4 s of every CPU worker's stop). Either way it
waits for the processes to end, so that the next engine (or worker) finds their memory free.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)
# How long to wait for an engine's processes to end once killed (a process's memory is freed as it ends).
PROCESS_EXIT_WAIT_S = 30.0


def engine_processes(entrypoint: Any) -> list[Any]:
    """The engine core processes of a vLLM ``AsyncLLM`` (vLLM 0.24-0.32: its client's ``resources.engine_manager``,
    a ``CoreEngineProcManager``, holds them as ``processes``); none for another kind of client."""
    manager = getattr(getattr(getattr(entrypoint, "engine_core", None), "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def kill_and_wait(entrypoint: Any) -> None:
    """Shut the ``AsyncLLM`` ``entrypoint`` down at once (its sockets closed, its core processes killed, not given
    vLLM's grace period) and wait until those processes have ended. A blocking call."""
    processes = engine_processes(entrypoint)
    entrypoint.shutdown(timeout=0)
    wait_ended(processes, PROCESS_EXIT_WAIT_S)


def wait_ended(processes: list[Any], timeout_s: float) -> None:
    """Wait until ``processes`` (multiprocessing processes) have ended, for ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.warning("engine process %s still runs %.0f s after it was killed", process.pid, timeout_s)
