"""Pins on the scheduler's side, on a real database: why pinned work waits (`waiting_reasons`), for jobs and for
harvests, against the versions live workers serve."""

from __future__ import annotations

from nnqueue.db.models import Harvest, Job, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler.registry import register
from nnqueue.scheduler.weights import waiting_reasons
from tests.utils.queued import add_harvest, queue_job

MODEL = "m"


def test_pinned_jobs_and_harvests_say_why_they_wait_while_no_live_worker_serves_their_version(
    any_database: str,
) -> None:
    sessions = session_factory(make_engine(any_database))
    register(sessions, "w-v1", MODEL, "q", 1, weights=("v1", {"kind": "checkpoint"}))
    served, unserved, unpinned, ended = (queue_job(sessions, MODEL) for _ in range(4))
    add_harvest(sessions, MODEL, "alice", 2)
    add_harvest(sessions, MODEL, "alice", 2)
    with transaction(sessions) as session:
        session.get(Job, served).weights_pin = "v1"  # type: ignore[union-attr]
        session.get(Job, unserved).weights_pin = "v2"  # type: ignore[union-attr]
        session.get(Job, ended).weights_pin = "v2"  # type: ignore[union-attr]
        session.get(Job, ended).status = JobStatus.CANCELLED  # type: ignore[union-attr]
        queued, running = session.query(Harvest).all()
        queued.weights_pin = running.weights_pin = "v2"
        running.status = JobStatus.RUNNING  # some chunks ran: the rest still wait for v2
        harvest_ids = queued.id, running.id

    with sessions() as session:
        jobs = [session.get(Job, job_id) for job_id in (served, unserved, unpinned, ended)]
        harvests = [session.get(Harvest, harvest_id) for harvest_id in harvest_ids]
        reasons = waiting_reasons(session, [*jobs, *harvests], stale_after_s=60.0)  # type: ignore[list-item]
    assert set(reasons) == {unserved, *harvest_ids}
    for reason in reasons.values():
        assert "'v2'" in reason and "serve v1" in reason, reason

    register(sessions, "w-v2", MODEL, "q", 1, weights=("v2", {"kind": "update"}))
    with sessions() as session:
        units = [session.get(Job, unserved), *(session.get(Harvest, harvest_id) for harvest_id in harvest_ids)]
        assert waiting_reasons(session, units, stale_after_s=60.0) == {}  # type: ignore[arg-type]
