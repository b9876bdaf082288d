"""Workers announce themselves in the database: one row per process, kept fresh by heartbeats.

The queries here are what the API and the scheduler ask of the registry (which models and engines are live,
what capture points they publish); the heartbeat thread that keeps a worker's row fresh is
:class:`nnqueue.workers.heartbeat.HeartbeatThread`.

The API lists models from live rows. A job RUNNING under a worker whose heartbeat went stale was
orphaned by a dead process: live workers of its model requeue it (nnqueue.scheduler.recovery).

Admission asks a looser question, "is the model *served*?": a model whose last live worker went away less
than ``NNQUEUE_WORKER_RESTART_GRACE_S`` ago still is (:func:`served_model_keys`), so that the jobs submitted
while its supervisor restarts a crashed worker are queued for the fresh one rather than refused.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from sqlalchemy import Select, select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import EngineKind, HarvestChunk, Job, JobStatus, Worker, utcnow
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
    weights: tuple[str, dict[str, Any]] | None = None,
) -> None:
    """Add the worker's row; with ``stale_after_s``, after :func:`check_engine`. ``capture_points``: what its
    engine can capture for harvests (None: it runs none); ``containment``: what its engine processes run under
    (``nnqueue.isolation.Containment.report``, shown on ``/readyz``); ``weights``: the version its engine serves
    and its source (:mod:`nnqueue.workers.weights`)."""
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
                weights_version=weights[0] if weights else None,
                weights_since=utcnow() if weights else None,
                weights_source=weights[1] if weights else None,
            )
        )


def set_weights(sessions: sessionmaker[Session], worker_id: str, version: str, source: dict[str, Any]) -> None:
    """Record the weights version the worker's engine serves now (after an update, or a failed one's error)."""
    with transaction(sessions) as session:
        row = session.get(Worker, worker_id)
        changed = row is None or row.weights_version != version
        values: dict[str, Any] = {"weights_version": version, "weights_source": source}
        if changed:
            values["weights_since"] = utcnow()
        session.execute(update(Worker).where(Worker.id == worker_id).values(**values))


def set_domain(sessions: sessionmaker[Session], worker_id: str, domain: str) -> None:
    """Record the trust domain whose traces the worker's engine runs from now on (nnqueue.scheduler.domain_turns)."""
    with transaction(sessions) as session:
        session.execute(update(Worker).where(Worker.id == worker_id).values(domain=domain, domain_since=utcnow()))


def heartbeat(sessions: sessionmaker[Session], worker_id: str) -> None:
    with transaction(sessions) as session:
        session.execute(update(Worker).where(Worker.id == worker_id).values(heartbeat_at=utcnow()))


def mark_stopped(sessions: sessionmaker[Session], worker_id: str) -> None:
    with transaction(sessions) as session:
        session.execute(update(Worker).where(Worker.id == worker_id).values(stopped_at=utcnow()))


def _live(stale_after_s: float) -> Select[Worker]:
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    return select(Worker).where(Worker.stopped_at.is_(None), Worker.heartbeat_at >= cutoff)


def _recent(stale_after_s: float, grace_s: float) -> Select[Worker]:
    """Workers live now, or live less than ``grace_s`` ago (stopped or silent since): their last heartbeat is
    at most ``stale_after_s + grace_s`` old. With no grace, the live workers; with an infinite one, every worker."""
    if grace_s <= 0:
        return _live(stale_after_s)
    if math.isinf(grace_s):
        return select(Worker)
    return select(Worker).where(Worker.heartbeat_at >= utcnow() - timedelta(seconds=stale_after_s + grace_s))


def served_engines(session: Session, stale_after_s: float, grace_s: float = 0.0) -> dict[str, frozenset[str]]:
    """The models with a worker live now or within the last ``grace_s`` (see the module's doc), each with the
    engine kinds of those workers."""
    query = _recent(stale_after_s, grace_s).with_only_columns(Worker.model_key, Worker.engine).distinct()
    engines: dict[str, set[str]] = {}
    for model_key, engine in session.execute(query):
        engines.setdefault(model_key, set()).add(engine)
    return {model_key: frozenset(kinds) for model_key, kinds in engines.items()}


def live_worker_ids(stale_after_s: float) -> Select[str]:
    """A query of the live workers' ids, for use as a subquery."""
    return _live(stale_after_s).with_only_columns(Worker.id)


def orphaned(
    session: Session, held: type[Job] | type[HarvestChunk], model_key: str, stale_after_s: float
) -> list[tuple[Any, str]]:
    """``model_key``'s RUNNING jobs or chunks (``held``) whose worker is not live: (id, that worker) each."""
    rows = session.execute(
        select(held.id, held.worker_id).where(
            held.model_key == model_key,
            held.status == JobStatus.RUNNING,
            held.worker_id.is_not(None),  # NULL is in no NOT IN list; a RUNNING row's worker is set when claimed
            held.worker_id.not_in(live_worker_ids(stale_after_s)),
        )
    )
    return [(row_id, str(worker_id)) for row_id, worker_id in rows]


def live_workers(session: Session, stale_after_s: float) -> list[Worker]:
    """Workers that have not stopped and have sent a heartbeat within ``stale_after_s``."""
    return list(session.scalars(_live(stale_after_s).order_by(Worker.model_key, Worker.id)))


def live_engines(session: Session, model_key: str, stale_after_s: float) -> set[str]:
    """The engine kinds of ``model_key``'s live workers (empty when none is live)."""
    query = _live(stale_after_s).where(Worker.model_key == model_key).with_only_columns(Worker.engine).distinct()
    return set(session.scalars(query))


def live_capture_points(
    session: Session, model_key: str, stale_after_s: float, grace_s: float = 0.0
) -> list[dict[str, Any]] | None:
    """The capture points that ``model_key``'s workers live now or within ``grace_s`` published (the newest that
    published any; empty when none did, as workers that run no harvests), or None when there is no such worker."""
    query = (
        _recent(stale_after_s, grace_s)
        .where(Worker.model_key == model_key)
        .order_by(Worker.heartbeat_at.desc())
        .with_only_columns(Worker.capture_points)
    )
    published = list(session.scalars(query))
    if not published:
        return None
    return next((points for points in published if points), [])


class LiveModels:
    """The served models and their engines (:func:`served_engines`, with ``grace_s``), read at most every
    ``max_age_s`` to answer "is it served, and by which engines?".

    A model not in the remembered set is looked up again before the answer is no, so a worker that has just
    registered is found at once; a model whose last worker just died may be taken for served ``max_age_s``
    longer (its jobs then wait in the queue, as any job does whose workers die after it was accepted).
    """

    def __init__(
        self, stale_after_s: float, max_age_s: float = 1.0, grace_s: float = 0.0, always: Iterable[str] = ()
    ) -> None:
        """``always``: models taken for served by a vLLM engine with or without a worker (scaled to zero)."""
        self.stale_after_s, self.max_age_s, self.grace_s = stale_after_s, max_age_s, grace_s
        self.always = frozenset(always)
        self._engines: dict[str, frozenset[str]] = {}
        self._read_at = -math.inf

    def engines(self, session: Session, model_key: str) -> frozenset[str]:
        """The engine kinds serving ``model_key`` (empty: it is not served)."""
        if model_key in self._engines and time.monotonic() - self._read_at < self.max_age_s:
            return self._engines[model_key]
        return self.read(session).get(model_key, frozenset())

    def serves(self, session: Session, model_key: str) -> bool:
        return bool(self.engines(session, model_key))

    def read(self, session: Session) -> dict[str, frozenset[str]]:
        """The served models now and their engines, remembered for the next ``max_age_s``."""
        read_at = time.monotonic()
        engines = served_engines(session, self.stale_after_s, self.grace_s)
        for model_key in self.always:
            engines[model_key] = engines.get(model_key, frozenset()) | {EngineKind.VLLM.value}
        self._engines = engines
        self._read_at = read_at
        return self._engines
