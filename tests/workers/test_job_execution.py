"""JobRunner on the session's in-process engine, real Postgres and a local store: a job taken from this
worker while it runs (requeued because the worker looked dead, then claimed by another) is aborted at the
next heartbeat's reap, leaves the other worker's claim alone, and writes no result."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnqueue.db.lifecycle import create_job, transition
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.engines.builders import BuilderPool
from nnqueue.engines.outbox import OutboxPoller
from nnqueue.storage.keys import payload_key
from nnqueue.storage.local import LocalObjectStore
from nnqueue.workers.job_execution import JobRunner, Outcome
from nnqueue.workers.sinks import ResultSinks
from nnqueue.workers.trace_execution import VLLMTraceExecutor
from tests.utils.engines import InProcessEngine
from tests.utils.payloads import slow_payload

S = JobStatus


def test_a_job_taken_from_a_running_worker_is_aborted_and_not_finished(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    job_id = uuid.uuid4()
    size = store.put_bytes(payload_key(job_id), slow_payload(client_model, steps=50))  # about 5 s
    with transaction(sessions) as session:
        job = Job(
            id=job_id,
            owner="alice",
            model_key="tiny",
            kind=JobKind.TRACE,
            timeout_s=120,
            payload_key=payload_key(job_id),
            payload_size=size,
        )
        create_job(session, job)
    model = inprocess_engine.model
    executor = VLLMTraceExecutor(
        sessions,
        store,
        model,
        ResultSinks(store, tmp_path / ".handoff"),
        OutboxPoller(model.vllm_entrypoint),
        BuilderPool("", {}, 0, 0),
    )
    runner = JobRunner(sessions, executor, "tiny", "w-looked-dead")

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


def _running_requests(engine: InProcessEngine) -> int:
    async def count() -> int:
        return sum(await engine.model.vllm_entrypoint.collective_rpc("nnsight_request_count"))

    return engine.run(count())
