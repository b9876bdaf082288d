"""``nnqueue worker`` supervises the worker process and starts it again when it fails.

A worker exits non-zero when it cannot go on: its engine died (``EXIT_ENGINE_DIED``, after it settled
its jobs, see :mod:`nnqueue.workers.engine_health`), or it crashed. The supervisor is a small process
that holds no engine: it runs the worker (``nnqueue worker --no-supervise ...``) in a session of its
own, waits for it, kills whatever the worker left behind in that session (engine processes), and starts
it again after a backoff: 1 s, doubling up to a minute, and back to 1 s after a worker that served for a
healthy interval (``NNQUEUE_SUPERVISOR_HEALTHY_AFTER_S``) before it exited. A worker counts as serving from
when it tells the supervisor that it is ready (:func:`report_ready`, SIGUSR1, once it has registered: its engine
loaded), so the engine's load, which a crash loop repeats, never counts: a worker that crashes at every start
backs off up to a minute, one that crashes now and then (a user's trace killed its engine) restarts after 1 s
each time. SIGTERM and SIGINT are passed to the worker, which shuts down warmly; the supervisor then
exits with the worker's status. Any other exit is one the supervisor did not ask for, and is restarted,
exit 0 included: a worker can be made to exit 0 from outside (Celery's remote-control ``shutdown``, were
it on; a trace that reached the broker). The one exception is a worker whose very first start exits 2:
it was misconfigured (a bad option, a conflicting engine, an install that cannot import vLLM, a database not
migrated to its revision), and starting it again would not help.

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
READY_SIGNAL = signal.SIGUSR1
CONFIGURATION_ERROR = 2  # a bad option or a conflicting engine: starting again would not help


class Supervisor:
    def __init__(self, command: Sequence[str], healthy_after_s: float) -> None:
        """``healthy_after_s``: how long a worker must serve (from its :func:`report_ready`) for the backoff to reset."""
        self.command = list(command)
        self.healthy_after_s = healthy_after_s
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()
        self.restarts = 0
        self.ready_at: float | None = None  # when the running worker reported ready

    def _ready(self, _signum: int, _frame: FrameType | None) -> None:
        self.ready_at = time.monotonic()

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        """Run the worker, and again whenever it exits, until the supervisor is told to stop (or the first start
        exits with :data:`CONFIGURATION_ERROR`); returns the worker's last exit status."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._forward)
        signal.signal(READY_SIGNAL, self._ready)
        backoff = FIRST_BACKOFF_S
        while True:
            self.ready_at = None
            code = self._run_once()
            if self.stopping.is_set() or (code == CONFIGURATION_ERROR and self.restarts == 0):
                return code
            if self.ready_at is not None and time.monotonic() - self.ready_at >= self.healthy_after_s:
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


def report_ready() -> None:
    """In a supervised worker: tell the supervisor that the worker serves (its backoff's healthy interval starts)."""
    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if supervisor:
        os.kill(int(supervisor), READY_SIGNAL)


def exit_with_supervisor() -> None:
    """In a supervised worker: die with the supervisor (the kernel sends SIGKILL when it exits)."""
    from nnqueue import isolation

    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if not supervisor:
        return
    isolation.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(supervisor):  # it died before the signal was armed
        os._exit(1)
