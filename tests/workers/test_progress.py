"""A worker's progress writes: every running job's in one statement, throttled, never after the job left RUNNING."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import transition
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from tests.utils.queued import queue_job

S = JobStatus
FIRST_S, EVERY_S = 0.2, 0.4


@pytest.fixture
def sessions(any_database: str) -> sessionmaker[Session]:
    return session_factory(make_engine(any_database))


def running_jobs(sessions: sessionmaker[Session], count: int, worker_id: str = "w") -> list[uuid.UUID]:
    ids = [queue_job(sessions, "m") for _ in range(count)]
    with transaction(sessions) as session:
        for job_id in ids:
            transition(session, job_id, S.RUNNING, worker_id=worker_id)
    return ids


def progress(sessions: sessionmaker[Session], ids: list[uuid.UUID]) -> list[tuple[int, int | None]]:
    with sessions() as session:
        rows = session.execute(select(Job.id, Job.progress_done, Job.progress_total).where(Job.id.in_(ids)))
        found = {job_id: (done, total) for job_id, done, total in rows}
    return [found[job_id] for job_id in ids]


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_every_running_jobs_progress_is_written_in_one_statement_after_the_first_delay(
    sessions: sessionmaker[Session],
) -> None:
    from nnqueue.workers.job_execution import ProgressBook

    ids = running_jobs(sessions, 20)
    updates: list[str] = []
    event.listen(
        sessions.kw["bind"],
        "before_cursor_execute",
        lambda *args: updates.append(args[2]) if "UPDATE" in args[2] else None,
    )
    book = ProgressBook(sessions, "w", first_s=FIRST_S, every_s=EVERY_S)

    async def run() -> None:
        for job_id in ids:
            book.report(job_id, 0, 4)
        await asyncio.sleep(FIRST_S / 2)
        assert progress(sessions, ids) == [(0, None)] * 20  # nothing before the first delay
        await eventually(lambda: progress(sessions, ids) == [(0, 4)] * 20)
        for job_id in ids:
            book.report(job_id, 2, 4)
        book.report(ids[0], 4, 4)  # all done is the job's end to write, not progress's
        await eventually(lambda: progress(sessions, ids) == [(2, 4)] * 20)
        await asyncio.sleep(EVERY_S + FIRST_S)  # nothing new: nothing more written

    asyncio.run(run())
    assert progress(sessions, ids) == [(2, 4)] * 20
    assert len(updates) == 2  # one statement per round for all 20 jobs (an executemany)


def test_no_progress_is_written_for_a_job_that_ended_or_left_this_worker(sessions: sessionmaker[Session]) -> None:
    from nnqueue.workers.job_execution import ProgressBook

    ended, taken, forgotten = running_jobs(sessions, 3)
    book = ProgressBook(sessions, "w", first_s=FIRST_S, every_s=EVERY_S)

    async def run() -> None:
        for job_id in (ended, taken, forgotten):
            book.report(job_id, 1, 3)
        book.forget(forgotten)
        with transaction(sessions) as session:
            transition(session, ended, S.COMPLETED, progress_done=3, progress_total=3)
            transition(session, taken, S.QUEUED)
            transition(session, taken, S.RUNNING, worker_id="another")
        await asyncio.sleep(3 * FIRST_S)

    asyncio.run(run())
    assert progress(sessions, [ended, taken, forgotten]) == [(3, 3), (0, None), (0, None)]
