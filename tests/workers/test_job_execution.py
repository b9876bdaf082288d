"""JobRunner on the session's in-process engine, real Postgres and a local store: a job taken from this
worker while it runs (requeued because the worker looked dead, then claimed by another) is aborted at the
next heartbeat's reap, leaves the other worker's claim alone, and writes no result; tokens that arrive
together claim their jobs together; each job's timeline passes every point of its run, in order."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import Ending, create_job, transition
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.engines.builders import BuilderPool
from nnqueue.engines.outbox import OutboxPoller
from nnqueue.storage.keys import payload_key
from nnqueue.storage.local import LocalObjectStore
from nnqueue.timeline import POINTS, Timelines
from nnqueue.workers.job_execution import JobRunner, Outcome
from nnqueue.workers.sinks import ResultSinks
from nnqueue.workers.trace_execution import VLLMTraceExecutor
from tests.utils.engines import InProcessEngine
from tests.utils.payloads import slow_payload, two_invoke_payload
from tests.utils.queued import queue_job

S = JobStatus


def test_a_job_taken_from_a_running_worker_is_aborted_and_not_finished(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    [job_id] = _queue(sessions, store, [slow_payload(client_model, steps=50)])  # about 5 s
    runner = _runner(sessions, store, inprocess_engine, tmp_path, "w-looked-dead")

    outcome = asyncio.run_coroutine_threadsafe(runner.run_next(), inprocess_engine.host.loop)
    deadline = time.monotonic() + 30
    while runner.running_jobs() != [job_id] or not _running_requests(inprocess_engine):
        assert time.monotonic() < deadline and not outcome.done(), "the job did not start"
        time.sleep(0.05)
    # Another worker's sweep requeues it and a third claims it, while this runner is still decoding.
    for target, fields in ((S.QUEUED, {}), (S.RUNNING, {"worker_id": "w-new"})):
        with transaction(sessions) as session:
            transition(session, job_id, target, **fields)

    assert runner.reap_lost() == [job_id]
    assert outcome.result(timeout=30) is Outcome.SKIPPED
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None and (job.status, job.worker_id, job.result_key) == (S.RUNNING, "w-new", None)
    assert not (tmp_path / "results").exists() and not any((tmp_path / ".handoff").rglob("*.pt"))
    assert _running_requests(inprocess_engine) == 0  # the aborted requests freed the engine


def test_tokens_that_arrive_together_claim_their_jobs_in_one_transaction(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    job_ids = _queue(sessions, store, [two_invoke_payload(client_model)] * 12)
    runner = _runner(sessions, store, inprocess_engine, tmp_path, "w")
    claims: list[str] = []
    event.listen(
        sessions.kw["bind"],
        "before_cursor_execute",
        lambda *args: (
            claims.append(args[2])
            if args[2].startswith("UPDATE jobs SET status") and "started_at=" in args[2]
            else None
        ),
    )

    async def tokens() -> list[Outcome]:
        return await asyncio.gather(*(runner.run_next() for _ in range(13)))

    outcomes = asyncio.run_coroutine_threadsafe(tokens(), inprocess_engine.host.loop).result(timeout=120)
    assert sorted(outcomes) == sorted([Outcome.COMPLETED] * 12 + [Outcome.NO_WORK])
    assert 1 <= len(claims) <= 3  # the first token's claim, then the others' together (a claim per token: 13)
    with sessions() as session:
        rows = session.execute(select(Job.status, Job.worker_id, Job.result_key).where(Job.id.in_(job_ids))).all()
    assert all(status is S.COMPLETED and worker == "w" and key for status, worker, key in rows) and len(rows) == 12


def test_each_jobs_timeline_passes_every_point_of_its_run_in_order(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    _queue(sessions, store, [two_invoke_payload(client_model)] * 3)
    runner = _runner(sessions, store, inprocess_engine, tmp_path, "w")
    runner.timelines = Timelines()

    async def tokens() -> list[Outcome]:
        return await asyncio.gather(*(runner.run_next() for _ in range(4)))

    outcomes = asyncio.run_coroutine_threadsafe(tokens(), inprocess_engine.host.loop).result(timeout=120)
    assert sorted(outcomes) == sorted([Outcome.COMPLETED] * 3 + [Outcome.NO_WORK])
    assert len(runner.timelines.finished) == 3  # the token that found no job ran none
    for kept in runner.timelines.finished:
        assert list(kept.stamps) == list(POINTS)  # every point, in the order the run passed them
        assert list(kept.stamps.values()) == sorted(kept.stamps.values())
    assert runner.timelines.percentiles()["whole run"]["jobs"] == 3


def test_one_jobs_bad_end_does_not_fail_the_others_that_ended_with_it(database_factory: Callable[..., str]) -> None:
    sessions = session_factory(make_engine(database_factory()))
    good, bad = (queue_job(sessions, "tiny") for _ in range(2))
    with transaction(sessions) as session:
        for job_id in (good, bad):
            transition(session, job_id, S.RUNNING, worker_id="w")
    runner = JobRunner(sessions, cast(Any, None), "tiny", "w")
    ended, refused = runner._end(
        [
            Ending(good, S.COMPLETED, {}, {"result_key": "results/good"}),
            Ending(bad, S.FAILED, {}, {"error_type": "E", "error_message": "a NUL \x00 Postgres refuses"}),
        ]
    )
    assert isinstance(ended, Job) and (ended.status, ended.result_key) == (S.COMPLETED, "results/good")
    assert isinstance(refused, Exception) and not isinstance(refused, Job)
    with sessions() as session:
        assert session.get(Job, good).status is S.COMPLETED  # type: ignore[union-attr]
        assert session.get(Job, bad).status is S.RUNNING  # type: ignore[union-attr]


def _queue(sessions: sessionmaker[Session], store: LocalObjectStore, payloads: list[bytes]) -> list[uuid.UUID]:
    job_ids = []
    for payload in payloads:
        job_id = uuid.uuid4()
        size = store.put_bytes(payload_key(job_id), payload)
        job = Job(
            id=job_id,
            owner="alice",
            model_key="tiny",
            kind=JobKind.TRACE,
            timeout_s=120,
            payload_key=payload_key(job_id),
            payload_size=size,
        )
        with transaction(sessions) as session:
            create_job(session, job)
        job_ids.append(job_id)
    return job_ids


def _runner(
    sessions: sessionmaker[Session], store: LocalObjectStore, engine: InProcessEngine, tmp_path: Path, worker_id: str
) -> JobRunner:
    model = engine.model
    executor = VLLMTraceExecutor(
        sessions,
        store,
        model,
        ResultSinks(store, tmp_path / ".handoff"),
        OutboxPoller(model.vllm_entrypoint),
        BuilderPool("", {}, 0, 0),
    )
    return JobRunner(sessions, executor, "tiny", worker_id)


def _running_requests(engine: InProcessEngine) -> int:
    async def count() -> int:
        return sum(await engine.model.vllm_entrypoint.collective_rpc("nnsight_request_count"))

    return engine.run(count())
