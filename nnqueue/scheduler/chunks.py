"""A harvest chunk's state changes after its claim (:mod:`nnqueue.scheduler.claim`), and its harvest's.

Every change is a guarded UPDATE (status, and the holding worker where one holds it), so a worker that
was taken for dead, a cancel and a retry racing on one chunk cannot both win. A chunk that fails goes
back to QUEUED with a fresh token until it has been tried ``max_attempts`` times; then it FAILS and so
does its harvest, naming the chunk and the cause, and the harvest's other chunks are CANCELLED (the
workers running them abort them at their next heartbeat, as for a cancel).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import Harvest, HarvestChunk, JobStatus, utcnow
from nnqueue.db.session import transaction, updated
from nnqueue.scheduler.enqueue import send_chunk_tokens
from nnqueue.scheduler.registry import orphaned

log = logging.getLogger(__name__)
S = JobStatus
OPEN = (S.QUEUED, S.RUNNING)


@dataclass(frozen=True)
class ChunkOutput:
    """What a finished chunk wrote: its shard's rows, bytes and sha256, the tokens it ran, per-prompt offsets,
    its per-capture statistics (`nnqueue.enginecore.harvest_stats`), its rows of generated tokens and what its
    outliers option did (`nnqueue.engines.harvest_runner.ChunkResult.outliers`)."""

    rows: int
    bytes: int
    sha256: str
    tokens: int
    offsets: list[int]
    stats: dict[str, Any] | None = None
    weights_version: str | None = None  # the weights version it ran on (nnqueue.workers.weights)
    generated_rows: int = 0
    outliers: dict[str, Any] | None = None


def finish_chunk(sessions: sessionmaker[Session], chunk_id: int, worker_id: str, output: ChunkOutput) -> bool:
    """Mark the chunk COMPLETED if this worker still holds it; returns whether it did."""
    with transaction(sessions) as session:
        done = updated(
            session,
            update(HarvestChunk)
            .where(HarvestChunk.id == chunk_id, HarvestChunk.status == S.RUNNING, HarvestChunk.worker_id == worker_id)
            .values(
                status=S.COMPLETED,
                finished_at=utcnow(),
                rows=output.rows,
                bytes=output.bytes,
                sha256=output.sha256,
                tokens=output.tokens,
                offsets=output.offsets,
                stats=output.stats,
                weights_version=output.weights_version,
                generated_rows=output.generated_rows,
                outliers=output.outliers,
                error=None,
            ),
        )
        return done == 1


def retry_or_fail_chunk(
    sessions: sessionmaker[Session],
    app: Celery,
    chunk_id: int,
    worker_id: str | None,
    cause: str,
    max_attempts: int,
) -> JobStatus | None:
    """A chunk held by ``worker_id`` (None: by whoever holds it) failed with ``cause``.

    Returns QUEUED (it will be tried again), FAILED (out of attempts: its harvest failed too), or None
    when the chunk was no longer RUNNING under that worker (cancelled, or taken over).
    """
    with transaction(sessions) as session:
        chunk = session.get(HarvestChunk, chunk_id, with_for_update=True)
        if chunk is None or chunk.status is not S.RUNNING or (worker_id is not None and chunk.worker_id != worker_id):
            return None
        retry = chunk.attempts < max_attempts
        target = S.QUEUED if retry else S.FAILED
        values = {"queued_at": utcnow()} if retry else {"finished_at": utcnow()}
        guards = (
            HarvestChunk.id == chunk_id,
            HarvestChunk.status == S.RUNNING,
            HarvestChunk.worker_id == chunk.worker_id,
        )
        if updated(session, update(HarvestChunk).where(*guards).values(status=target, error=cause, **values)) != 1:
            return None
        if not retry:
            message = f"chunk {chunk.index} failed after {chunk.attempts} attempts: {cause}"
            _end_harvest(session, chunk.harvest_id, S.FAILED, error_type="ChunkFailed", error_message=message)
        model_key = chunk.model_key
    if retry:
        try:
            send_chunk_tokens(app, model_key)
        except Exception:  # the reconciler sends it at a later heartbeat
            log.exception("chunk %s requeued, but its token could not be sent; the reconciler will", chunk_id)
    return target


def requeue_chunk(sessions: sessionmaker[Session], app: Celery, chunk_id: int, worker_id: str, reason: str) -> bool:
    """Put a chunk ``worker_id`` holds back to QUEUED, its attempt not counted (it did not run: a pinned chunk on an
    engine that moved to another weights version); False if it was no longer held."""
    with transaction(sessions) as session:
        back = updated(
            session,
            update(HarvestChunk)
            .where(HarvestChunk.id == chunk_id, HarvestChunk.status == S.RUNNING, HarvestChunk.worker_id == worker_id)
            .values(status=S.QUEUED, queued_at=utcnow(), error=reason, attempts=HarvestChunk.attempts - 1),
        )
        model_key = session.scalar(select(HarvestChunk.model_key).where(HarvestChunk.id == chunk_id))
    if back == 1 and model_key is not None:
        send_chunk_tokens(app, model_key)
    return back == 1


def requeue_orphan_chunks(
    sessions: sessionmaker[Session], app: Celery, model_key: str, stale_after_s: float, max_attempts: int
) -> list[int]:
    """Requeue (or fail, when out of attempts) ``model_key``'s RUNNING chunks whose worker is not live."""
    with sessions() as session:
        orphans = orphaned(session, HarvestChunk, model_key, stale_after_s)
    handled = []
    for chunk_id, dead_worker in orphans:
        if retry_or_fail_chunk(sessions, app, chunk_id, dead_worker, f"worker {dead_worker} lost", max_attempts):
            handled.append(chunk_id)
    return handled


def cancel_harvest(sessions: sessionmaker[Session], harvest_id: uuid.UUID) -> bool:
    """CANCEL a QUEUED or RUNNING harvest and its open chunks; False if it had already ended."""
    with transaction(sessions) as session:
        return _end_harvest(session, harvest_id, S.CANCELLED)


def complete_harvest(sessions: sessionmaker[Session], harvest_id: uuid.UUID, manifest_key: str) -> bool:
    """Mark a RUNNING harvest whose chunks all completed COMPLETED with its manifest; False if it was not."""
    with transaction(sessions) as session:
        done = updated(
            session,
            update(Harvest)
            .where(Harvest.id == harvest_id, Harvest.status == S.RUNNING)
            .values(status=S.COMPLETED, finished_at=utcnow(), manifest_key=manifest_key),
        )
        return done == 1


def finished_harvests(sessions: sessionmaker[Session], model_key: str) -> list[uuid.UUID]:
    """``model_key``'s open harvests whose chunks have all completed: each is complete but for its manifest (the
    worker that finished the last chunk stopped, or was stopped, before it wrote it)."""
    unfinished = select(HarvestChunk.id).where(
        HarvestChunk.harvest_id == Harvest.id, HarvestChunk.status != S.COMPLETED
    )
    any_chunk = select(HarvestChunk.id).where(HarvestChunk.harvest_id == Harvest.id)
    with sessions() as session:
        return list(
            session.scalars(
                select(Harvest.id).where(
                    Harvest.model_key == model_key,
                    Harvest.status == S.RUNNING,
                    any_chunk.exists(),
                    ~unfinished.exists(),
                )
            )
        )


def all_chunks_completed(session: Session, harvest_id: uuid.UUID) -> bool:
    unfinished = session.scalar(
        select(func.count())
        .select_from(HarvestChunk)
        .where(HarvestChunk.harvest_id == harvest_id, HarvestChunk.status != S.COMPLETED)
    )
    return unfinished == 0


def held_chunks(sessions: sessionmaker[Session], chunk_ids: list[int], worker_id: str) -> set[int]:
    """Which of ``chunk_ids`` are still RUNNING under ``worker_id``."""
    if not chunk_ids:
        return set()
    with sessions() as session:
        return set(
            session.scalars(
                select(HarvestChunk.id).where(
                    HarvestChunk.id.in_(chunk_ids),
                    HarvestChunk.status == S.RUNNING,
                    HarvestChunk.worker_id == worker_id,
                )
            )
        )


def _end_harvest(session: Session, harvest_id: uuid.UUID, target: JobStatus, **fields: str) -> bool:
    now = utcnow()
    ended = update(Harvest).where(Harvest.id == harvest_id, Harvest.status.in_(OPEN))
    if updated(session, ended.values(status=target, finished_at=now, **fields)) != 1:
        return False
    updated(
        session,
        update(HarvestChunk)
        .where(HarvestChunk.harvest_id == harvest_id, HarvestChunk.status.in_(OPEN))
        .values(status=S.CANCELLED, finished_at=now),
    )
    return True
