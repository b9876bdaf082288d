"""Engine processes end with the nnqueue worker that started them.

vLLM runs its engine core in a spawned child process. If the worker process is SIGKILLed (or the
machine's OOM killer picks it) the child is not told and would keep the model's memory — GPU memory
on a GPU host — forever. The worker exports its pid; this runs inside the engine process, beside the
model runner, and exits the process once that worker is gone.
"""

from __future__ import annotations

import os
import threading
import time

WORKER_PID_ENV = "NNQUEUE_WORKER_PID"


def exit_with_worker(poll_s: float = 1.0) -> None:
    """Start a thread that exits this process when the worker named by NNQUEUE_WORKER_PID is gone."""
    pid = os.environ.get(WORKER_PID_ENV)
    if not pid or int(pid) == os.getpid():
        return  # not started by an nnqueue worker (a test or a benchmark driving the engine itself)
    threading.Thread(target=_watch, args=(int(pid), poll_s), name="nnqueue-exit-with-worker", daemon=True).start()


def _watch(pid: int, poll_s: float) -> None:
    while not _gone(pid):
        time.sleep(poll_s)
    os._exit(1)


def _gone(pid: int) -> bool:
    # A killed worker whose parent has not reaped it yet is a zombie: gone, though its pid exists.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")
