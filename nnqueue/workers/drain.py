"""A stopping worker drains for a bounded time, then hands back to the queue what it still holds.

SIGTERM (Kubernetes before it kills a pod, Slurm before a preemption or the time limit, ``docker stop``,
the supervisor passing on its own) starts Celery's warm shutdown: Celery takes no new token and waits for the
jobs its pool runs. At that moment (Celery's ``worker_shutting_down`` signal, sent from the signal handler in
the main thread) the :class:`Drain` also stops the bulk consumer, so no new harvest chunk is claimed, and
starts its clock. Running jobs and chunks then have ``NNQUEUE_WORKER_DRAIN_S`` to finish (unset: as long as
they take). When it passes, each job and chunk still held goes back to QUEUED with a fresh token, guarded by
this worker as holder (:func:`nnqueue.scheduler.recovery.requeue_held`,
:func:`nnqueue.scheduler.chunks.retry_or_fail_chunk`), and its run here is aborted, which aborts its engine
requests: Celery's wait ends and the worker exits 0, within the drain plus the engine's shutdown. A job or
chunk handed back counts the attempt it had begun, as one taken from a dead worker does.

Without this, a worker killed at the end of its orchestrator's grace left its work RUNNING until a live
worker of the model saw it stale (``NNQUEUE_WORKER_STALE_AFTER_S``), and not at all while no worker of the
model was alive; and with traces allowed to run for a day, no grace period could cover "until they end".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import signals

log = logging.getLogger(__name__)
POLL_S = 0.2


class Drain:
    """The worker's shutdown: ``stop_taking`` at SIGTERM, then ``hand_back`` what is held when time is up."""

    def __init__(
        self,
        drain_s: float | None,
        stop_taking: Callable[[], None],
        running: Callable[[], int],
        hand_back: Callable[[str], None],
    ) -> None:
        """``stop_taking``: stop claiming work; ``running``: how many jobs and chunks run here now;
        ``hand_back(reason)``: requeue and abort them."""
        self.drain_s, self._stop_taking, self._running, self._hand_back = drain_s, stop_taking, running, hand_back
        self._started: float | None = None
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._clock: threading.Thread | None = None
        self._handler: Callable[..., None] | None = None

    def connect(self) -> None:
        """Begin when this process's Celery worker starts its warm shutdown (there is one per worker process); a
        cold shutdown (a second Ctrl-C, SIGQUIT) ends the drain at once."""

        def shutting_down(how: str = "Warm", **_: Any) -> None:
            self.begin()
            if how == "Cold":
                self._cut.set()

        self._handler = shutting_down
        signals.worker_shutting_down.connect(shutting_down, weak=False)

    def begin(self) -> None:
        """Stop taking work and start the clock (once; later signals change nothing). Safe in a signal handler:
        the waiting is on a thread."""
        with self._lock:
            if self._started is not None:
                return
            self._started = time.monotonic()
        log.info(
            "stopping: no new work; running jobs and chunks have %s to finish",
            "as long as they take" if self.drain_s is None else f"{self.drain_s:g} s",
        )
        self._stop_taking()
        self._clock = threading.Thread(target=self._wait, name="nnqueue-drain", daemon=True)
        self._clock.start()

    def finish(self) -> None:
        """After Celery's pool has stopped: wait out the drain for the chunks still running (Celery waits only
        for its jobs) and the hand-back of what is left. Begins the drain if no signal did."""
        if self._handler is not None:
            signals.worker_shutting_down.disconnect(self._handler)
        self.begin()
        assert self._clock is not None
        self._clock.join()

    def _wait(self) -> None:
        """The drain's clock: hand back what still runs when it ends (work only ends meanwhile: none is taken)."""
        assert self._started is not None
        while self._running() and not self._cut.is_set():
            if self.drain_s is not None and time.monotonic() - self._started >= self.drain_s:
                break
            time.sleep(POLL_S)
        if self._running():
            why = "cold shutdown" if self._cut.is_set() else f"not finished within its drain of {self.drain_s:g} s"
            self._hand_back(f"the worker stopped; {why}")
