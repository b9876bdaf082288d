"""Claiming work: a worker that received a token takes the best QUEUED unit of its model from the database.

Messages name no job (see :mod:`nnqueue.broker`), so the database decides what runs next:

* interactive jobs (traces, steering): fairly across owners, round robin counting what each already runs
  (:mod:`nnqueue.scheduler.fair_share`), and traces of one trust domain at a time per engine: the worker's
  :class:`~nnqueue.scheduler.domain_turns.DomainTurns` grants what this claim may take, from the domains whose
  work waits (:func:`waiting_domains`, :func:`waiting_work`); steering jobs run no user code and are taken whatever
  their domain, but where a domain's turn covers all its work (``NNQUEUE_DOMAIN_SWITCH=restart``);
* harvest chunks: fairly across owners: the owner with the fewest RUNNING chunks on the model first,
  then the highest priority, then the oldest. Two owners' harvests on one model thus alternate rather
  than the first one's thousands of chunks running before any of the second's. Where a domain's turn covers all
  its work, the worker's turns grant them as they grant steering jobs.

On Postgres the claimed rows are locked with ``FOR UPDATE SKIP LOCKED``, so concurrent claims take
different rows without waiting on each other. SQLite has no row locks (and SQLAlchemy renders no
``FOR UPDATE`` there); its claim is the compare-and-set of the status change, and a claim that loses
the race tries the next candidate. A token that finds nothing to claim is simply dropped (or, on a worker whose
domain's turn keeps other domains' traces waiting, waits for the turn to end: ``JobRunner``). A worker claims
jobs for all its tokens that arrived together in one transaction (:func:`claim_jobs`).
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable
from datetime import datetime

from sqlalchemy import ColumnElement, false, func, or_, select, true, update
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from nnqueue.db.lifecycle import start_queued
from nnqueue.db.models import Harvest, HarvestChunk, Job, JobKind, JobStatus, utcnow
from nnqueue.db.session import transaction, updated
from nnqueue.scheduler.domain_turns import DomainTurns, Grant
from nnqueue.scheduler.fair_share import fair_order, ranked
from nnqueue.scheduler.trust_domains import chunk_domain, job_domain, job_domain_of

S = JobStatus
# Claims that lose a race (SQLite) try again this many times before giving the token up.
MAX_TRIES = 8


def runnable_on(pin: InstrumentedAttribute[str | None], weights_version: str | None) -> ColumnElement[bool]:
    """A unit whose weights pin (``pin``) lets it run on an engine serving ``weights_version``: unpinned, or pinned
    to that version (:mod:`nnqueue.scheduler.weights`)."""
    return or_(pin.is_(None), pin == weights_version) if weights_version is not None else pin.is_(None)


def claim_jobs(
    sessions: sessionmaker[Session],
    model_key: str,
    worker_id: str,
    limit: int,
    weights_version: str | None = None,
    turns: DomainTurns | None = None,
) -> list[Job]:
    """Move up to ``limit`` of the best QUEUED jobs of ``model_key`` that may run on ``weights_version`` to RUNNING
    under ``worker_id``, in one transaction, and return them best first (fewer, or none, when fewer are queued).

    Their traces are all of one trust domain, the one ``turns`` (the worker's; None: a worker that ran no trace
    yet) grants; ``turns`` learns what was claimed."""
    turns = turns if turns is not None else DomainTurns()
    with turns.claiming:
        with transaction(sessions) as session:
            grant = _grant(session, turns, model_key, weights_version)
            traces = (Job.kind == JobKind.TRACE) & (job_domain == grant.traces) if grant.traces else false()
            work = Job.kind != JobKind.TRACE
            if grant.work is not None:
                work &= job_domain.in_(grant.work)
            jobs = ranked(
                (Job.model_key == model_key) & runnable_on(Job.weights_pin, weights_version) & or_(traces, work)
            )
            claimed: list[uuid.UUID] = []
            passed: list[uuid.UUID] = []  # held by another claim (Postgres' SKIP LOCKED): not tried again
            for _ in range(MAX_TRIES):
                best = select(jobs.c.id).where(jobs.c.id.not_in(passed)).order_by(*fair_order(jobs))
                job_ids = session.scalars(best.limit(limit - len(claimed))).all()
                if not job_ids:
                    break
                free = session.scalars(
                    select(Job.id).where(Job.id.in_(job_ids), Job.status == S.QUEUED).with_for_update(skip_locked=True)
                ).all()
                passed += [job_id for job_id in job_ids if job_id not in free]
                # Those another worker (or a cancel) took between our read and our write are left out: try the next.
                won = set(start_queued(session, free, worker_id))
                claimed += [job_id for job_id in job_ids if job_id in won]
                if len(claimed) == limit:
                    break
            if not claimed:
                return []
            loaded = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(claimed)))}
            rows = [loaded[job_id] for job_id in claimed]
        turns.claimed(
            grant,
            [job.id for job in rows if job.kind is JobKind.TRACE],
            {job.id: job_domain_of(job) for job in rows if job.kind is not JobKind.TRACE},
        )
    return rows


def _grant(session: Session, turns: DomainTurns, model_key: str, weights_version: str | None) -> Grant:
    """What ``turns`` lets the claim take, from the work waiting."""
    traces = waiting_domains(session, model_key, weights_version, turns.allowed)
    return turns.choose(traces, waiting_work(session, model_key, weights_version) if turns.all_work else None)


def waiting_domains(
    session: Session, model_key: str, weights_version: str | None, allowed: frozenset[str] | None = None
) -> dict[str, datetime]:
    """The trust domains with traces of ``model_key`` QUEUED that an engine serving ``weights_version`` may run
    (of ``allowed`` only, unless None), each with its oldest one's queueing time."""
    query = (
        select(job_domain, func.min(Job.queued_at))
        .where(
            Job.model_key == model_key,
            Job.status == S.QUEUED,
            Job.kind == JobKind.TRACE,
            runnable_on(Job.weights_pin, weights_version),
        )
        .group_by(job_domain)
    )
    if allowed is not None:
        query = query.where(job_domain.in_(allowed))
    return {domain: oldest for domain, oldest in session.execute(query) if oldest is not None}


def waiting_work(session: Session, model_key: str, weights_version: str | None) -> dict[str, datetime]:
    """The trust domains with steering jobs or harvest chunks of ``model_key`` QUEUED that an engine serving
    ``weights_version`` may run, each with its oldest one's queueing time."""
    jobs = select(job_domain, func.min(Job.queued_at)).where(
        Job.model_key == model_key,
        Job.status == S.QUEUED,
        Job.kind != JobKind.TRACE,
        runnable_on(Job.weights_pin, weights_version),
    )
    domain = chunk_domain()
    chunks = select(domain, func.min(HarvestChunk.queued_at)).where(
        HarvestChunk.model_key == model_key,
        HarvestChunk.status == S.QUEUED,
        runnable_on(HarvestChunk.weights_pin, weights_version),
    )
    oldest: dict[str, datetime] = {}
    for query, by in ((jobs, job_domain), (chunks, domain)):
        for name, queued in session.execute(query.group_by(by)):
            if queued is not None:
                oldest[name] = min(queued, oldest.get(name, queued))
    return oldest


def chunk_key(chunk_id: int) -> Hashable:
    """A harvest chunk as a unit of :class:`DomainTurns` (a job's is its id)."""
    return ("chunk", chunk_id)


def claim_next_chunk(
    sessions: sessionmaker[Session],
    model_key: str,
    worker_id: str,
    weights_version: str | None = None,
    turns: DomainTurns | None = None,
) -> HarvestChunk | None:
    """Move the fairest QUEUED chunk of ``model_key`` that may run on ``weights_version`` to RUNNING under
    ``worker_id``; None if there is none (or none ``turns`` grants: a worker whose domain turns cover all work).

    The chunk's harvest becomes RUNNING with its first chunk.
    """
    if turns is None or not turns.all_work:
        claimed = _claim_chunk(sessions, model_key, worker_id, weights_version, Grant(None))
        return claimed[0] if claimed else None
    with turns.claiming:
        with transaction(sessions) as session:
            grant = _grant(session, turns, model_key, weights_version)
        claimed = _claim_chunk(sessions, model_key, worker_id, weights_version, grant)
        if claimed is None:
            return None
        chunk, domain = claimed
        turns.claimed(grant, work={chunk_key(chunk.id): domain})
        return chunk


def _claim_chunk(
    sessions: sessionmaker[Session], model_key: str, worker_id: str, weights_version: str | None, grant: Grant
) -> tuple[HarvestChunk, str] | None:
    """The chunk :func:`claim_next_chunk` claims among those ``grant`` lets it take, and its domain."""
    running = (
        select(HarvestChunk.owner, func.count().label("running"))
        .where(HarvestChunk.model_key == model_key, HarvestChunk.status == S.RUNNING)
        .group_by(HarvestChunk.owner)
        .subquery()
    )
    domain = chunk_domain()
    candidate = (
        select(HarvestChunk.id, domain)
        .outerjoin(running, running.c.owner == HarvestChunk.owner)
        .where(
            HarvestChunk.model_key == model_key,
            HarvestChunk.status == S.QUEUED,
            runnable_on(HarvestChunk.weights_pin, weights_version),
            domain.in_(grant.work) if grant.work is not None else true(),
        )
        .order_by(
            func.coalesce(running.c.running, 0), HarvestChunk.priority.desc(), HarvestChunk.queued_at, HarvestChunk.id
        )
        .limit(1)
        .with_for_update(skip_locked=True, of=HarvestChunk)
    )
    for _ in range(MAX_TRIES):
        with transaction(sessions) as session:
            found = session.execute(candidate).first()
            if found is None:
                return None
            chunk_id, domain_now = found
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
            return chunk, domain_now
    return None
