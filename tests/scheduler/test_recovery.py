"""A dead worker's RUNNING jobs and harvest chunks go back on their queue at a live worker's heartbeat, on real
Postgres and Redis: the job row, its history and the new token are read back; live workers' and other
models' jobs stay as they are; of the two tokens a requeued job then has, only one runs it; a chunk out of
attempts fails its harvest instead. (The whole path with worker processes: tests/workers/test_harvest.py.)"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.broker import RUN_JOB_TASK, create_celery_app, queue_name
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import Harvest, HarvestChunk, JobEvent, JobStatus, Worker, utcnow
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler import registry
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.scheduler.chunks import requeue_orphan_chunks
from nnqueue.scheduler.claim import claim_next_chunk
from nnqueue.scheduler.recovery import requeue_orphans
from nnqueue.scheduler.submission import submit_job
from nnqueue.settings import Settings
from nnqueue.storage.local import LocalObjectStore
from tests.utils.queued import add_harvest, claim_next_job

S = JobStatus
STALE_AFTER_S = 30.0
# The jobs were submitted while their workers were alive: admission counts the since-silent workers as live.
ADMISSION = AdmissionPolicy(stale_after_s=10 * STALE_AFTER_S, max_jobs_in_flight_per_key=100)


def start_job(
    sessions: sessionmaker[Session], app: Celery, store: LocalObjectStore, model_key: str, worker: str
) -> uuid.UUID:
    """A job RUNNING on ``worker``, its submission's token already taken off the queue."""
    job = submit_job(sessions, store, app, admission=ADMISSION, owner="alice", model_key=model_key, payload=b"trace")
    assert drain(app, model_key) == [model_key]
    with transaction(sessions) as session:
        transition(session, job.id, S.RUNNING, worker_id=worker)
    return job.id


def drain(app: Celery, model_key: str) -> list[str]:
    """The tokens on the model's queue (each names the model), taken off it."""
    ids = []
    with app.connection_for_read() as connection, connection.SimpleQueue(queue_name(model_key)) as queue:
        while True:
            try:
                message = queue.get(timeout=1)
            except queue.Empty:
                return ids
            assert message.headers["task"] == RUN_JOB_TASK
            ids.extend(message.payload[0])
            message.ack()


def new_worker(sessions: sessionmaker[Session], model_key: str, silent_for_s: float = 0.0) -> str:
    worker_id = registry.new_worker_id()
    registry.register(sessions, worker_id, model_key, queue_name(model_key), capacity=1)
    with transaction(sessions) as session:
        session.execute(
            update(Worker).where(Worker.id == worker_id).values(heartbeat_at=utcnow() - timedelta(seconds=silent_for_s))
        )
    return worker_id


@dataclass
class Queue:
    sessions: sessionmaker[Session]
    app: Celery
    store: LocalObjectStore


@pytest.fixture
def queue(database_factory: Callable[..., str], redis_url: str, tmp_path: Path) -> Queue:
    sessions = session_factory(make_engine(database_factory()))
    return Queue(
        sessions, create_celery_app(Settings(_env_file=None, broker_url=redis_url)), LocalObjectStore(tmp_path)
    )


def test_a_dead_workers_running_jobs_are_requeued_with_a_new_token(queue: Queue) -> None:
    sessions, app, store = queue.sessions, queue.app, queue.store
    model, other_model = f"m-{uuid.uuid4().hex[:8]}", f"o-{uuid.uuid4().hex[:8]}"
    dead = new_worker(sessions, model, silent_for_s=2 * STALE_AFTER_S)
    stopped = new_worker(sessions, model)
    registry.mark_stopped(sessions, stopped)
    alive = new_worker(sessions, model)
    dead_elsewhere = new_worker(sessions, other_model, silent_for_s=2 * STALE_AFTER_S)

    orphan = start_job(sessions, app, store, model, dead)
    left_by_a_clean_stop = start_job(sessions, app, store, model, stopped)
    healthy = start_job(sessions, app, store, model, alive)
    other = start_job(sessions, app, store, other_model, dead_elsewhere)

    requeued = requeue_orphans(sessions, app, model, STALE_AFTER_S)

    assert sorted(requeued) == sorted([orphan, left_by_a_clean_stop])
    assert drain(app, model) == [model] * len(requeued)  # a token for each
    with sessions() as session:
        status = dict(session.execute(select(JobEvent.job_id, JobEvent.to_status).order_by(JobEvent.id)).all())
        reasons = dict(
            session.execute(
                select(JobEvent.job_id, JobEvent.detail).where(JobEvent.to_status == S.QUEUED).order_by(JobEvent.id)
            ).all()
        )
    assert status == {orphan: S.QUEUED, left_by_a_clean_stop: S.QUEUED, healthy: S.RUNNING, other: S.RUNNING}
    assert reasons[orphan] == {"reason": f"worker {dead} lost"}
    # Nothing is requeued twice: a second sweep (another worker's) finds them QUEUED.
    assert requeue_orphans(sessions, app, model, STALE_AFTER_S) == []
    assert drain(app, other_model) == []


def test_after_a_requeue_only_the_first_of_two_tokens_runs_the_job(queue: Queue) -> None:
    sessions, model = queue.sessions, f"m-{uuid.uuid4().hex[:8]}"
    dead = new_worker(sessions, model, silent_for_s=2 * STALE_AFTER_S)
    first, second = new_worker(sessions, model), new_worker(sessions, model)
    job_id = start_job(sessions, queue.app, queue.store, model, dead)
    assert requeue_orphans(sessions, queue.app, model, STALE_AFTER_S) == [job_id]

    claimed = claim_next_job(sessions, model, first)  # the new token
    assert claimed is not None and claimed.id == job_id and claimed.worker_id == first and claimed.attempts == 2
    assert claim_next_job(sessions, model, second) is None  # the dead worker's redelivered token: no work
    with sessions() as session:
        history = session.execute(select(JobEvent.to_status).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
        assert list(history.scalars()) == [S.QUEUED, S.RUNNING, S.QUEUED, S.RUNNING]


def test_a_dead_workers_running_chunks_are_requeued_or_fail_their_harvest(queue: Queue) -> None:
    sessions, app = queue.sessions, queue.app
    model = f"m-{uuid.uuid4().hex[:8]}"
    dead = new_worker(sessions, model, silent_for_s=2 * STALE_AFTER_S)
    alive = new_worker(sessions, model)
    [first] = add_harvest(sessions, model, "alice", 1)
    [second] = add_harvest(sessions, model, "bob", 1)
    [healthy] = add_harvest(sessions, model, "carol", 1)
    held = {claim_next_chunk(sessions, model, worker).id: worker for worker in (dead, dead, alive)}  # type: ignore[union-attr]
    assert held == {first: dead, second: dead, healthy: alive}
    with transaction(sessions) as session:  # bob's chunk has used its last attempt
        session.execute(update(HarvestChunk).where(HarvestChunk.id == second).values(attempts=2))

    handled = requeue_orphan_chunks(sessions, app, model, STALE_AFTER_S, max_attempts=2)

    assert sorted(handled) == sorted([first, second])
    with sessions() as session:
        chunks = {chunk.id: chunk for chunk in session.scalars(select(HarvestChunk))}
        harvest = session.get_one(Harvest, chunks[second].harvest_id)
    assert chunks[first].status is S.QUEUED and chunks[healthy].status is S.RUNNING
    assert harvest.status is S.FAILED and f"worker {dead} lost" in (harvest.error_message or "")
    assert requeue_orphan_chunks(sessions, app, model, STALE_AFTER_S, max_attempts=2) == []
