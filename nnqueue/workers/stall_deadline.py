"""The hard step deadline: intervention code that the stall watchdog could not stop is stopped by killing its engine.

The engine's stall watchdog (:mod:`nnqueue.enginecore.stall_watchdog`) stops a stalled intervention with an
asynchronous exception, which lands only when the code next runs bytecode: code blocked in C (``time.sleep(1000)``,
a catastrophic regular expression, a loop in a C extension) would hold the forward, and so every job on the
engine, for as long as it likes. This thread of the worker reads where the engine's forward is
(:mod:`nnqueue.enginecore.stall_beacon`) every :data:`POLL_S` seconds. When the forward of one of this worker's
engine processes has been in one intervention's code for longer than the stall timeout plus :data:`GRACE_S` (the
exception's chance to land), seen at two polls in a row, it writes the engine's crash report (cause ``"stall"``, the request whose code it was) and
kills that engine process (SIGKILL). The engine's death then takes the usual path
(:mod:`nnqueue.workers.engine_health`): the job whose code it was fails with ``InterventionStalled``, the other
jobs on the engine are requeued as they were, and a fresh engine serves them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from nnqueue.enginecore.crash_report import save_report
from nnqueue.enginecore.stall_beacon import InUserCode, read_all

log = logging.getLogger(__name__)

POLL_S = 0.5
# How long past the stall timeout the watchdog's exception has to stop the code before the engine is killed.
GRACE_S = 2.0
STALL_CAUSE = "stall"


class StallDeadline(threading.Thread):
    """See the module doc; ``crash_dir``: the engine's crash report directory. Watches every engine the worker
    starts there (a fresh one replaces a killed one: :mod:`nnqueue.workers.engine_restart`), each switch at most
    once. ``engine_cores``: the pids of the engine's core processes now; only those and their descendants are
    killed. A beacon is a file the engine's processes write, and its name says whose it is: a fourth red-team round
    wrote one named for the trace builders' root zygote, and the worker killed that (and restarted, every domain
    without service for 75 s)."""

    def __init__(self, crash_dir: Path, stall_timeout_s: float, engine_cores: Callable[[], Iterable[int]]) -> None:
        super().__init__(name="nnqueue-stall-deadline", daemon=True)
        self.crash_dir = crash_dir
        self.stall_timeout_s = stall_timeout_s
        self.deadline_s = stall_timeout_s + GRACE_S
        self.engine_cores = engine_cores

    def run(self) -> None:
        overdue: set[InUserCode] = set()
        stopped: set[InUserCode] = set()  # its process may linger a moment, its beacon until the engine's restart
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            overdue_now = [each for each in read_all(self.crash_dir) if now - each.started > self.deadline_s]
            cores = set(self.engine_cores()) if overdue_now else set()
            seen = {each for each in overdue_now if of_engine(each.pid, cores)} - stopped
            for each in seen & overdue:  # the same switch at two polls: not a torn read
                self.stop(each, now)
                stopped.add(each)
            overdue = seen - stopped

    def stop(self, stalled: InUserCode, now: float) -> None:
        """Report ``stalled``'s request as the engine's crash and kill its engine process."""
        message = (
            f"intervention code ran for more than {self.stall_timeout_s:g} s without returning control to the model"
            f" and was still running {now - stalled.started - self.stall_timeout_s:.1f} s later, in code that could"
            " not be interrupted (a sleep, a regular expression or other code running in C?): the engine was killed"
            " to stop it, and the other jobs on it run again"
        )
        report = {"request_ids": [stalled.request_id], "error": f"InterventionStalled: {message}", "cause": STALL_CAUSE}
        try:
            save_report(self.crash_dir, stalled.pid, report)
        except OSError as error:  # the folder is the engine's: it may have made the name unusable
            log.warning("the stall report of engine process %d could not be written: %s", stalled.pid, error)
        log.error("killing engine process %d: request %s: %s", stalled.pid, stalled.request_id, message)
        try:
            os.kill(stalled.pid, signal.SIGKILL)
        except ProcessLookupError:
            log.warning("engine process %d had already ended", stalled.pid)


def of_engine(pid: int, cores: Collection[int]) -> bool:
    """Whether process ``pid`` runs and is one of ``cores`` or their descendant (a model runner): only this worker's
    engine processes are killed, never another of its processes a beacon names, nor one that took the pid of an
    engine process that died with a beacon still raised."""
    while pid > 1:
        if pid in cores:
            return Path(f"/proc/{pid}").exists()
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False
