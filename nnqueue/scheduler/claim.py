"""Claiming work: a worker that received a token takes the best QUEUED unit of its model from the database.

Messages name no job (see :mod:`nnqueue.broker`), so the database decides what runs next:

* interactive jobs: the highest ``priority`` first, then the oldest (``queued_at``, then id);
* harvest chunks: fairly across owners: the owner with the fewest RUNNING chunks on the model first,
  then the highest priority, then the oldest. Two owners' harvests on one model thus alternate rather
  than the first one's thousands of chunks running before any of the second's.

On Postgres the candidate row is locked with ``FOR UPDATE SKIP LOCKED``, so concurrent claims take
different rows without waiting on each other. SQLite has no row locks (and SQLAlchemy renders no
``FOR UPDATE`` there); its claim is the compare-and-set of the status change, and a claim that loses
the race tries the next candidate. A token that finds nothing to claim is simply dropped. A worker claims
jobs for all its tokens that arrived together in one transaction (:func:`claim_jobs`).
"""

from __future__ import annotations

import uuid

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from nnqueue.db.lifecycle import start_queued
from nnqueue.db.models import Harvest, HarvestChunk, Job, JobStatus, utcnow
from nnqueue.db.session import transaction, updated

S = JobStatus
# Claims that lose a race (SQLite) try again this many times before giving the token up.
MAX_TRIES = 8
# The order in which a model's QUEUED jobs run, and in which queue positions are counted.
JOB_ORDER = (Job.priority.desc(), Job.queued_at, Job.id)


def runnable_on(pin: InstrumentedAttribute[str | None], weights_version: str | None) -> ColumnElement[bool]:
    """A unit whose weights pin (``pin``) lets it run on an engine serving ``weights_version``: unpinned, or pinned
    to that version (:mod:`nnqueue.scheduler.weights`)."""
    return or_(pin.is_(None), pin == weights_version) if weights_version is not None else pin.is_(None)


def claim_jobs(
    sessions: sessionmaker[Session], model_key: str, worker_id: str, limit: int, weights_version: str | None = None
) -> list[Job]:
    """Move up to ``limit`` of the best QUEUED jobs of ``model_key`` that may run on ``weights_version`` to RUNNING
    under ``worker_id``, in one transaction, and return them best first (fewer, or none, when fewer are queued)."""
    candidates = (
        select(Job.id)
        .where(Job.model_key == model_key, Job.status == S.QUEUED, runnable_on(Job.weights_pin, weights_version))
        .order_by(*JOB_ORDER)
        .with_for_update(skip_locked=True)
    )
    with transaction(sessions) as session:
        claimed: list[uuid.UUID] = []
        for _ in range(MAX_TRIES):
            job_ids = session.scalars(candidates.limit(limit - len(claimed))).all()
            if not job_ids:
                break
            # Those another worker (or a cancel) took between our read and our write are left out: try the next.
            claimed += start_queued(session, job_ids, worker_id)
            if len(claimed) == limit:
                break
        if not claimed:
            return []
        return list(session.scalars(select(Job).where(Job.id.in_(claimed)).order_by(*JOB_ORDER)))


def claim_next_chunk(
    sessions: sessionmaker[Session], model_key: str, worker_id: str, weights_version: str | None = None
) -> HarvestChunk | None:
    """Move the fairest QUEUED chunk of ``model_key`` that may run on ``weights_version`` to RUNNING under
    ``worker_id``; None if there is none.

    The chunk's harvest becomes RUNNING with its first chunk.
    """
    running = (
        select(HarvestChunk.owner, func.count().label("running"))
        .where(HarvestChunk.model_key == model_key, HarvestChunk.status == S.RUNNING)
        .group_by(HarvestChunk.owner)
        .subquery()
    )
    candidate = (
        select(HarvestChunk.id)
        .outerjoin(running, running.c.owner == HarvestChunk.owner)
        .where(
            HarvestChunk.model_key == model_key,
            HarvestChunk.status == S.QUEUED,
            runnable_on(HarvestChunk.weights_pin, weights_version),
        )
        .order_by(
            func.coalesce(running.c.running, 0), HarvestChunk.priority.desc(), HarvestChunk.queued_at, HarvestChunk.id
        )
        .limit(1)
        .with_for_update(skip_locked=True, of=HarvestChunk)
    )
    for _ in range(MAX_TRIES):
        with transaction(sessions) as session:
            chunk_id = session.scalar(candidate)
            if chunk_id is None:
                return None
            now = utcnow()
            claimed = updated(
                session,
                update(HarvestChunk)
                .where(HarvestChunk.id == chunk_id, HarvestChunk.status == S.QUEUED)
                .values(status=S.RUNNING, worker_id=worker_id, started_at=now, attempts=HarvestChunk.attempts + 1),
            )
            if claimed != 1:
                continue  # lost the race (SQLite): try the next candidate
            chunk = session.get(HarvestChunk, chunk_id, populate_existing=True)
            assert chunk is not None
            updated(
                session,
                update(Harvest)
                .where(Harvest.id == chunk.harvest_id, Harvest.status == S.QUEUED)
                .values(status=S.RUNNING, started_at=now),
            )
            return chunk
    return None
