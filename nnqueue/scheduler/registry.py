"""Workers announce themselves in the database: one row per process, kept fresh by heartbeats.

The queries here are what the API and the scheduler ask of the registry (which models and engines are live,
what capture points they publish); the heartbeat thread that keeps a worker's row fresh is
:class:`nnqueue.workers.heartbeat.HeartbeatThread`.

The API lists models from live rows. A job RUNNING under a worker whose heartbeat went stale was
orphaned by a dead process: live workers of its model requeue it (nnqueue.scheduler.recovery).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import Select, select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import EngineKind, Worker, utcnow
from nnqueue.db.session import transaction
from nnqueue.errors import NNqueueError

log = logging.getLogger(__name__)


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class EngineConflict(NNqueueError):
    """Live workers of another engine kind already serve the model key (they would share its queue)."""


def check_engine(session: Session, model_key: str, engine: EngineKind, stale_after_s: float) -> None:
    """Raise :class:`EngineConflict` when live workers of another engine kind serve ``model_key``: the queue is
    per model key, so they would take each other's jobs."""
    others = sorted(live_engines(session, model_key, stale_after_s) - {engine.value})
    if others:
        raise EngineConflict(
            f"live workers with a {' and a '.join(others)} engine already serve model key {model_key!r}; "
            f"give this {engine.value} worker another --model-key"
        )


def register(
    sessions: sessionmaker[Session],
    worker_id: str,
    model_key: str,
    queue: str,
    capacity: int,
    engine: EngineKind = EngineKind.VLLM,
    stale_after_s: float | None = None,
    capture_points: list[dict[str, Any]] | None = None,
    containment: dict[str, str] | None = None,
) -> None:
    """Add the worker's row; with ``stale_after_s``, after :func:`check_engine`. ``capture_points``: what its
    engine can capture for harvests (None: it runs none); ``containment``: what its engine processes run under
    (``nnqueue.isolation.Containment.report``, shown on ``/readyz``)."""
    with transaction(sessions) as session:
        if stale_after_s is not None:
            check_engine(session, model_key, engine, stale_after_s)
        session.add(
            Worker(
                id=worker_id,
                model_key=model_key,
                queue=queue,
                host=socket.gethostname(),
                pid=os.getpid(),
                capacity=capacity,
                engine=engine.value,
                capture_points=capture_points,
                containment=containment,
            )
        )


def heartbeat(sessions: sessionmaker[Session], worker_id: str) -> None:
    with transaction(sessions) as session:
        session.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=utcnow()))


def mark_stopped(sessions: sessionmaker[Session], worker_id: str) -> None:
    with transaction(sessions) as session:
        session.execute(update(Worker).where(Worker.id == worker_id).values(stopped_at=utcnow()))


def _live(stale_after_s: float) -> Select[Worker]:
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    return select(Worker).where(Worker.stopped_at.is_(None), Worker.heartbeat_at >= cutoff)


def live_worker_ids(stale_after_s: float) -> Select[str]:
    """A query of the live workers' ids, for use as a subquery."""
    return _live(stale_after_s).with_only_columns(Worker.id)


def live_workers(session: Session, stale_after_s: float) -> list[Worker]:
    """Workers that have not stopped and have sent a heartbeat within ``stale_after_s``."""
    return list(session.scalars(_live(stale_after_s).order_by(Worker.model_key, Worker.id)))


def live_engines(session: Session, model_key: str, stale_after_s: float) -> set[str]:
    """The engine kinds of ``model_key``'s live workers (empty when none is live)."""
    query = _live(stale_after_s).where(Worker.model_key == model_key).with_only_columns(Worker.engine).distinct()
    return set(session.scalars(query))


def live_capture_points(session: Session, model_key: str, stale_after_s: float) -> list[dict[str, Any]] | None:
    """The capture points that ``model_key``'s live workers published (the first that published any; empty when
    none did, as workers that run no harvests), or None when no live worker serves the model."""
    query = _live(stale_after_s).where(Worker.model_key == model_key).with_only_columns(Worker.capture_points)
    published = list(session.scalars(query))
    if not published:
        return None
    return next((points for points in published if points), [])


class LiveModels:
    """The keys of the models with live workers, read at most every ``max_age_s`` to answer "is it served?".

    A model not in the remembered set is looked up again before the answer is no, so a worker that has just
    registered is found at once; a model whose last worker just died may be taken for live ``max_age_s``
    longer (its jobs then wait in the queue, as any job does whose workers die after it was accepted).
    """

    def __init__(self, stale_after_s: float, max_age_s: float = 1.0) -> None:
        self.stale_after_s, self.max_age_s = stale_after_s, max_age_s
        self._keys: frozenset[str] = frozenset()
        self._read_at = -math.inf

    def serves(self, session: Session, model_key: str) -> bool:
        if model_key in self._keys and time.monotonic() - self._read_at < self.max_age_s:
            return True
        return model_key in self.read(session)

    def read(self, session: Session) -> frozenset[str]:
        """The live models now, remembered for the next ``max_age_s``."""
        read_at = time.monotonic()
        self._keys = frozenset(
            session.scalars(_live(self.stale_after_s).with_only_columns(Worker.model_key).distinct())
        )
        self._read_at = read_at
        return self._keys
