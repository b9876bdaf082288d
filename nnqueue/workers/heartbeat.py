"""The worker's heartbeat thread: keeps its registry row fresh and runs the per-beat housekeeping."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from nnqueue.scheduler.registry import heartbeat

log = logging.getLogger(__name__)


class HeartbeatThread(threading.Thread):
    """Sends a heartbeat every ``interval_s`` and then runs ``on_beat`` (e.g. look for cancelled jobs)."""

    def __init__(
        self, sessions: sessionmaker[Session], worker_id: str, interval_s: float, on_beat: Callable[[], None]
    ) -> None:
        super().__init__(name="nnqueue-heartbeat", daemon=True)
        self._sessions, self._worker_id, self._interval_s, self._on_beat = sessions, worker_id, interval_s, on_beat
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                heartbeat(self._sessions, self._worker_id)
                self._on_beat()
            except Exception:  # a database blip must not stop the heartbeat for good
                log.exception("heartbeat of worker %s failed", self._worker_id)

    def stop(self) -> None:
        self._stopping.set()
