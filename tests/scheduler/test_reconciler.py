"""The reconciler re-sends the tokens a Redis restart lost, on real Postgres and a real Redis server that is
restarted empty; it sends nothing while the broker holds enough, and a surplus token finds no work. Work pinned to
a weights version no live worker serves gets no token until a worker serving it is live."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from celery import Celery

from nnqueue.broker import bulk_queue_name, create_celery_app, queue_name, ready_messages
from nnqueue.db.models import HarvestChunk, Job, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler import reconciler
from nnqueue.scheduler.enqueue import send_job_tokens
from nnqueue.scheduler.reconciler import Resent, reconcile
from nnqueue.scheduler.registry import register
from nnqueue.settings import Settings
from tests.utils import servers
from tests.utils.queued import add_harvest, claim_next_job, queue_job

MODEL = "m"
STALE_S = 60.0


@pytest.fixture
def redis() -> Iterator[list[servers.RedisServer]]:
    """A Redis of the test's own (it restarts it), in a one-element list so that the test can swap in the restart."""
    holder = [servers.start_redis()]
    yield holder
    holder[0].stop()


def test_tokens_lost_with_redis_are_resent_once(
    redis: list[servers.RedisServer], database_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciler, "GRACE_S", 0.0)
    sessions = session_factory(make_engine(database_factory()))
    app: Celery = create_celery_app(Settings(_env_file=None, broker_url=redis[0].url))
    jobs = [queue_job(sessions, MODEL) for _ in range(5)]
    send_job_tokens(app, MODEL, len(jobs))  # as their submissions did
    add_harvest(sessions, MODEL, "alice", 3)  # chunks whose tokens were never sent (a failed send, say)
    assert ready_messages(app, queue_name(MODEL)) == 5
    assert reconcile(sessions, app, MODEL, STALE_S) == Resent(jobs=0, chunks=3)  # the jobs have theirs

    redis[0] = servers.restart_redis_empty(redis[0])
    assert ready_messages(app, queue_name(MODEL)) == 0  # the tokens are gone; the jobs are still QUEUED
    assert reconcile(sessions, app, MODEL, STALE_S) == Resent(jobs=5, chunks=3)
    assert ready_messages(app, queue_name(MODEL)) == 5 and ready_messages(app, bulk_queue_name(MODEL)) == 3
    assert reconcile(sessions, app, MODEL, STALE_S) == Resent(jobs=0, chunks=0)  # nothing twice

    # A claim consumes work, not a particular token: the surplus token of a claimed job finds nothing.
    claimed = [claim_next_job(sessions, MODEL, "w") for _ in range(6)]
    assert {job.id for job in claimed if job} == set(jobs) and claimed[-1] is None
    with transaction(sessions) as session:
        session.query(HarvestChunk).update({HarvestChunk.status: JobStatus.RUNNING})
    assert reconcile(sessions, app, MODEL, STALE_S) == Resent(jobs=0, chunks=0)


def test_work_pinned_to_a_version_no_live_worker_serves_gets_its_token_when_one_comes(
    redis: list[servers.RedisServer], database_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciler, "GRACE_S", 0.0)
    sessions = session_factory(make_engine(database_factory()))
    app: Celery = create_celery_app(Settings(_env_file=None, broker_url=redis[0].url))
    register(sessions, "w-v1", MODEL, queue_name(MODEL), 1, weights=("v1", {"kind": "checkpoint"}))
    _, old, new = (queue_job(sessions, MODEL) for _ in range(3))
    [chunk] = add_harvest(sessions, MODEL, "alice", 1)
    with transaction(sessions) as session:
        session.get(Job, old).weights_pin = "v1"  # type: ignore[union-attr]
        session.get(Job, new).weights_pin = "v2"  # type: ignore[union-attr]
        session.get(HarvestChunk, chunk).weights_pin = "v2"  # type: ignore[union-attr]

    # Only the unpinned job and the one pinned to v1 (served) can be claimed: the v2 work would burn a token
    # at every interval.
    assert reconcile(sessions, app, MODEL, STALE_S) == Resent(jobs=2, chunks=0)
    assert reconcile(sessions, app, MODEL, STALE_S) == Resent(jobs=0, chunks=0)

    register(sessions, "w-v2", MODEL, queue_name(MODEL), 1, weights=("v2", {"kind": "update"}))
    assert reconcile(sessions, app, MODEL, STALE_S) == Resent(jobs=1, chunks=1)
