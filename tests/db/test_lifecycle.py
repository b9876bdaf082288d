"""Job status changes: the allowed graph, the event history, and compare-and-set under races."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db import migrate
from nnqueue.db.lifecycle import (
    Ending,
    InvalidTransition,
    JobNotFound,
    create_job,
    finish_held,
    start_queued,
    transition,
)
from nnqueue.db.models import Job, JobEvent, JobKind, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction

S = JobStatus


@pytest.fixture
def sessions(empty_postgres_url: str) -> Iterator[sessionmaker[Session]]:
    migrate.upgrade(empty_postgres_url)
    engine = make_engine(empty_postgres_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def any_sessions(any_database: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(any_database)
    yield session_factory(engine)
    engine.dispose()


def _new_job(sessions: sessionmaker[Session]) -> uuid.UUID:
    with transaction(sessions) as session:
        job = create_job(
            session,
            Job(owner="alice", model_key="tiny", kind=JobKind.TRACE, payload_key="payloads/x", payload_size=3),
            detail={"by": "test"},
        )
        return job.id


def _history(sessions: sessionmaker[Session], job_id: uuid.UUID) -> list[tuple[S | None, S]]:
    with sessions() as session:
        rows = session.execute(
            select(JobEvent.from_status, JobEvent.to_status).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        )
        return [tuple(row) for row in rows]


def test_a_job_runs_to_completion_with_timestamps_attempts_and_history(sessions: sessionmaker[Session]) -> None:
    job_id = _new_job(sessions)
    with transaction(sessions) as session:
        job = transition(session, job_id, S.RUNNING, worker_id="w1")
        assert (job.status, job.attempts, job.worker_id) == (S.RUNNING, 1, "w1")
        assert job.started_at is not None and job.finished_at is None
    with transaction(sessions) as session:
        job = transition(session, job_id, S.COMPLETED, detail={"bytes": 10}, result_key="results/x", result_size=10)
        assert job.finished_at is not None and job.result_size == 10
    assert _history(sessions, job_id) == [(None, S.QUEUED), (S.QUEUED, S.RUNNING), (S.RUNNING, S.COMPLETED)]


def test_only_the_worker_holding_a_job_finishes_it(sessions: sessionmaker[Session]) -> None:
    # w1 looked dead: its job went back to the queue and w2 claimed it; w1 then tries to finish it.
    job_id = _new_job(sessions)
    for target, worker in ((S.RUNNING, "w1"), (S.QUEUED, None), (S.RUNNING, "w2")):
        with transaction(sessions) as session:
            transition(session, job_id, target, **({"worker_id": worker} if worker else {}))
    with pytest.raises(InvalidTransition, match="under worker w2, not w1"), transaction(sessions) as session:
        transition(session, job_id, S.COMPLETED, held_by="w1", result_key="results/w1")
    with transaction(sessions) as session:
        job = transition(session, job_id, S.COMPLETED, held_by="w2", result_key="results/w2")
    assert (job.status, job.worker_id, job.result_key) == (S.COMPLETED, "w2", "results/w2")


@pytest.mark.parametrize("terminal", [S.COMPLETED, S.FAILED, S.CANCELLED])
def test_a_finished_job_never_runs_again(sessions: sessionmaker[Session], terminal: JobStatus) -> None:
    job_id = _new_job(sessions)
    with transaction(sessions) as session:
        transition(session, job_id, S.RUNNING)
        transition(session, job_id, terminal)
    for target in (S.RUNNING, S.QUEUED, S.COMPLETED):
        with pytest.raises(InvalidTransition, match=f"is {terminal.value}; it cannot become {target.value}"):
            with transaction(sessions) as session:
                transition(session, job_id, target)
    with sessions() as session:
        assert session.get(Job, job_id).status is terminal
    assert len(_history(sessions, job_id)) == 3


def test_cancel_is_allowed_while_queued_and_while_running(sessions: sessionmaker[Session]) -> None:
    queued, running = _new_job(sessions), _new_job(sessions)
    with transaction(sessions) as session:
        transition(session, running, S.RUNNING)
        assert transition(session, queued, S.CANCELLED).status is S.CANCELLED
        assert transition(session, running, S.CANCELLED).status is S.CANCELLED


def test_a_queued_job_cannot_complete_without_running(sessions: sessionmaker[Session]) -> None:
    job_id = _new_job(sessions)
    with pytest.raises(InvalidTransition), transaction(sessions) as session:
        transition(session, job_id, S.COMPLETED)


def test_unknown_job(sessions: sessionmaker[Session]) -> None:
    with pytest.raises(JobNotFound), transaction(sessions) as session:
        transition(session, uuid.uuid4(), S.RUNNING)


def test_racing_transitions_have_exactly_one_winner(sessions: sessionmaker[Session]) -> None:
    # Eight workers (a redelivered task, say) try to start the same job at once: one may.
    job_id = _new_job(sessions)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def start() -> None:
        barrier.wait()
        try:
            with transaction(sessions) as session:
                transition(session, job_id, S.RUNNING)
            outcomes.append("won")
        except InvalidTransition:
            outcomes.append("lost")

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["lost"] * 7 + ["won"]
    with sessions() as session:
        assert session.get(Job, job_id).attempts == 1
    assert _history(sessions, job_id) == [(None, S.QUEUED), (S.QUEUED, S.RUNNING)]


def test_starting_many_starts_only_those_still_queued(any_sessions: sessionmaker[Session]) -> None:
    queued, cancelled, running = (_new_job(any_sessions) for _ in range(3))
    with transaction(any_sessions) as session:
        transition(session, cancelled, S.CANCELLED)
        transition(session, running, S.RUNNING, worker_id="w1")
    with transaction(any_sessions) as session:
        assert start_queued(session, [queued, cancelled, running], "w2") == [queued]
    with any_sessions() as session:
        rows = {job.id: (job.status, job.worker_id, job.attempts) for job in session.scalars(select(Job))}
    assert rows == {queued: (S.RUNNING, "w2", 1), cancelled: (S.CANCELLED, None, 0), running: (S.RUNNING, "w1", 1)}
    assert _history(any_sessions, queued) == [(None, S.QUEUED), (S.QUEUED, S.RUNNING)]
    assert _history(any_sessions, running) == [(None, S.QUEUED), (S.QUEUED, S.RUNNING)]  # nothing added


def test_finishing_many_ends_the_held_jobs_and_says_why_the_others_were_left(
    any_sessions: sessionmaker[Session],
) -> None:
    done, failed, cancelled, taken = (_new_job(any_sessions) for _ in range(4))
    with transaction(any_sessions) as session:
        for job_id in (done, failed, cancelled, taken):
            transition(session, job_id, S.RUNNING, worker_id="w1")
        transition(session, cancelled, S.CANCELLED)
        transition(session, taken, S.QUEUED)
        transition(session, taken, S.RUNNING, worker_id="w2")
    endings = [
        Ending(done, S.COMPLETED, {"result_bytes": 3}, {"result_key": "results/done", "progress_done": 2}),
        Ending(failed, S.FAILED, {"error": "Boom"}, {"error_type": "Boom", "error_message": "it broke"}),
        Ending(cancelled, S.COMPLETED, {}, {"result_key": "results/cancelled"}),
        Ending(taken, S.FAILED, {}, {"error_type": "Late"}),
        Ending(uuid.uuid4(), S.COMPLETED),
    ]
    with transaction(any_sessions) as session:
        results = finish_held(session, endings, "w1")

    ended, broke, lost_to_cancel, lost_to_w2, unknown = results
    assert isinstance(ended, Job) and (ended.status, ended.result_key, ended.progress_done) == (
        S.COMPLETED,
        "results/done",
        2,
    )
    assert ended.finished_at is not None
    assert isinstance(broke, Job) and (broke.status, broke.error_message) == (S.FAILED, "it broke")
    assert isinstance(lost_to_cancel, InvalidTransition) and lost_to_cancel.current is S.CANCELLED
    assert isinstance(lost_to_w2, InvalidTransition) and "under worker w2, not w1" in str(lost_to_w2)
    assert isinstance(unknown, JobNotFound)
    with any_sessions() as session:
        rows = {job.id: (job.status, job.result_key, job.error_type) for job in session.scalars(select(Job))}
    assert rows[cancelled] == (S.CANCELLED, None, None) and rows[taken] == (S.RUNNING, None, None)
    assert _history(any_sessions, done)[-1] == (S.RUNNING, S.COMPLETED)
    assert _history(any_sessions, failed)[-1] == (S.RUNNING, S.FAILED)
    assert _history(any_sessions, cancelled)[-1] == (S.RUNNING, S.CANCELLED)  # no event for the refused ending
