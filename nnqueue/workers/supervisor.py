"""``nnqueue worker`` supervises the worker process and starts it again when it fails.

A worker exits non-zero when it cannot go on: its engine died (``EXIT_ENGINE_DIED``, after it settled
its jobs, see :mod:`nnqueue.workers.engine_health`), or it crashed. The supervisor is a small process
that holds no engine: it runs the worker (``nnqueue worker --no-supervise ...``) in a session of its
own, waits for it, kills whatever the worker left behind in that session (engine processes), and starts
it again after a backoff (1 s, doubling up to a minute; back to 1 s once a worker has run for five
minutes). SIGTERM and SIGINT are passed to the worker, which shuts down warmly; the supervisor then
exits with the worker's status. Any other exit is one the supervisor did not ask for, and is restarted,
exit 0 included: a worker can be made to exit 0 from outside (Celery's remote-control ``shutdown``, were
it on; a trace that reached the broker). The one exception is a worker whose very first start exits 2:
it was misconfigured (a bad option, a conflicting engine), and starting it again would not help.

If the supervisor itself is killed, the kernel kills the worker (``PR_SET_PDEATHSIG``, set by the
worker at start), and the worker's engine processes follow it (:mod:`nnqueue.enginecore.lifetime`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from types import FrameType

log = logging.getLogger(__name__)

SUPERVISOR_PID_ENV = "NNQUEUE_SUPERVISOR_PID"
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
HEALTHY_AFTER_S = 300.0
CONFIGURATION_ERROR = 2  # a bad option or a conflicting engine: starting again would not help


class Supervisor:
    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()
        self.restarts = 0

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        """Run the worker, and again whenever it exits, until the supervisor is told to stop (or the first start
        exits with :data:`CONFIGURATION_ERROR`); returns the worker's last exit status."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._forward)
        backoff = FIRST_BACKOFF_S
        while True:
            started = time.monotonic()
            code = self._run_once()
            if self.stopping.is_set() or (code == CONFIGURATION_ERROR and self.restarts == 0):
                return code
            if time.monotonic() - started > HEALTHY_AFTER_S:
                backoff = FIRST_BACKOFF_S
            self.restarts += 1
            log.warning("worker exited with status %s; starting it again in %.0f s", code, backoff)
            if self.stopping.wait(backoff):
                return code
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    def _run_once(self) -> int:
        env = {**os.environ, SUPERVISOR_PID_ENV: str(os.getpid())}
        self.child = subprocess.Popen(self.command, env=env, start_new_session=True)
        if self.stopping.is_set():  # a signal that came while it was starting
            self.child.terminate()
        while True:
            try:
                code = self.child.wait()
                break
            except InterruptedError:
                continue
        try:  # the engine processes it may have left behind, in its session
            os.killpg(self.child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return code


def exit_with_supervisor() -> None:
    """In a supervised worker: die with the supervisor (the kernel sends SIGKILL when it exits)."""
    from nnqueue import isolation

    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if not supervisor:
        return
    isolation.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(supervisor):  # it died before the signal was armed
        os._exit(1)
