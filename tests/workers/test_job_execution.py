"""JobRunner on the session's in-process engine, real Postgres and a local store: a job taken from this
worker while it runs (requeued because the worker looked dead, then claimed by another) is aborted at the
next heartbeat's reap, leaves the other worker's claim alone, and writes no result; tokens that arrive
together claim their jobs together; two trust domains' traces never share the engine (tokens wait for the turn
to end rather than being dropped), and the switch puts back weights one domain's traces left changed before the
other's first trace runs; each job's timeline passes every point of its run, in order."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import Ending, create_job, transition
from nnqueue.db.models import Job, JobKind, JobStatus, Worker
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.engines.builders import BuilderPool
from nnqueue.engines.outbox import OutboxPoller
from nnqueue.isolation import Containment
from nnqueue.scheduler import registry
from nnqueue.storage.keys import payload_key
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.results import load_result
from nnqueue.timeline import POINTS, Timelines
from nnqueue.workers.sinks import ResultSinks
from tests.utils.engines import InProcessEngine
from tests.utils.payloads import PROMPTS, PrebuiltBackend, slow_payload, two_invoke_payload
from tests.utils.queued import queue_job

if TYPE_CHECKING:
    from nnqueue.workers.job_execution import JobRunner, Outcome

S = JobStatus


def test_a_job_taken_from_a_running_worker_is_aborted_and_not_finished(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    from nnqueue.workers.job_execution import Outcome

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
    from nnqueue.workers.job_execution import Outcome

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


def test_two_domains_traces_never_share_the_engine_and_waiting_tokens_are_kept(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    from nnqueue.workers.job_execution import Outcome

    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    payload = slow_payload(client_model, steps=5)  # about 0.5 s each: the turns overlap unless kept apart
    alice = _queue(sessions, store, [payload] * 2, owner="alice")
    bob = _queue(sessions, store, [payload] * 2, owner="bob")
    registry.register(sessions, "w", "tiny", "q", 4)
    runner = _runner(sessions, store, inprocess_engine, tmp_path, "w")

    async def tokens() -> list[Outcome]:
        return await asyncio.gather(*(runner.run_next() for _ in range(4)))

    outcomes = asyncio.run_coroutine_threadsafe(tokens(), inprocess_engine.host.loop).result(timeout=180)
    assert outcomes == [Outcome.COMPLETED] * 4  # bob's tokens waited for alice's turn: none was dropped
    with sessions() as session:
        rows = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(alice + bob)))}
        worker = session.get(Worker, "w")
    assert all(job.status is S.COMPLETED for job in rows.values())
    first, second = sorted([alice, bob], key=lambda ids: min(rows[job_id].started_at for job_id in ids))  # type: ignore[type-var]
    assert max(rows[job_id].finished_at for job_id in first) <= min(rows[job_id].started_at for job_id in second)  # type: ignore[type-var]
    assert worker is not None and worker.domain == runner.turns.current == f"owner:{rows[second[0]].owner}"


def test_a_switch_puts_back_weights_the_previous_domain_left_changed(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    """Alice's second trace keeps an alias of a weight made with ``.data`` (which gets a content check at its own
    step); her third writes through it, which the per-step check (version counters) does not see: it reads the
    weights only where a trace names a road past the counters, or every 30 s. That write is hers to keep in her
    own domain, but not bob's to run on: the switch reads all the weights before bob's trace."""
    import torch

    from nnqueue.workers.job_execution import Outcome

    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    steps = [logits_payload(client_model), stash_payload(client_model), write_through_stash_payload(client_model)]
    alice = _queue(sessions, store, [logits_payload(client_model), *steps], owner="alice")
    runner = _runner(sessions, store, inprocess_engine, tmp_path, "w")

    def run_one() -> Outcome:
        return asyncio.run_coroutine_threadsafe(runner.run_next(), inprocess_engine.host.loop).result(timeout=120)

    for _ in alice:
        run_one()
    [bob] = _queue(sessions, store, [logits_payload(client_model)], owner="bob")
    assert run_one() is Outcome.COMPLETED
    with sessions() as session:
        clean, after = (session.get(Job, job_id) for job_id in (alice[0], bob))
        assert clean is not None and after is not None and clean.result_key and after.result_key
    expected, got = (load_result(store.get_bytes(job.result_key))["logits"] for job in (clean, after))  # type: ignore[arg-type]
    assert torch.equal(got, expected)


def logits_payload(client: Any) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        logits = client.logits.save()
    return backend.payload


def stash_payload(client: Any) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client.model.norm._module.nnqueue_test_alias = client.model.norm.weight.data
        logits = client.logits.save()
    return backend.payload


def write_through_stash_payload(client: Any) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        norm = client.model.norm._module
        norm.nnqueue_test_alias.zero_()
        del norm.nnqueue_test_alias  # leaves the session's engine as it found it, the weights aside
        logits = client.logits.save()
    return backend.payload


def test_each_jobs_timeline_passes_every_point_of_its_run_in_order(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    from nnqueue.workers.job_execution import Outcome

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
    from nnqueue.workers.job_execution import JobRunner

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


def test_a_worker_whose_engine_is_not_isolated_runs_only_its_operators_traces(
    inprocess_engine: InProcessEngine, client_model: Any, database_factory: Callable[..., str], tmp_path: Path
) -> None:
    from nnqueue.workers.job_execution import Outcome

    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    payload = two_invoke_payload(client_model)
    mallorys, alices = _queue(sessions, store, [payload, payload], owners=["mallory", "alice"])
    runner = _runner(sessions, store, inprocess_engine, tmp_path, "w-degraded")
    kept_root = "engine processes keep root, because ..."
    runner.containment = Containment(
        None, kept_root, None, network_isolated=True, filesystem_private=True, operators=("alice",)
    )

    async def two_tokens() -> list[Outcome]:
        return [await runner.run_next(), await runner.run_next()]

    outcomes = asyncio.run_coroutine_threadsafe(two_tokens(), inprocess_engine.host.loop).result(timeout=120)
    assert outcomes == [Outcome.FAILED, Outcome.COMPLETED]  # mallory's was queued first
    with sessions() as session:
        refused, ran = session.get(Job, mallorys), session.get(Job, alices)
    assert refused is not None and ran is not None and ran.status is S.COMPLETED and ran.result_key
    assert (refused.status, refused.error_type, refused.result_key) == (S.FAILED, "EngineNotIsolated", None)
    assert refused.error_message is not None and "engine processes keep root" in refused.error_message
    assert "its operator's (NNQUEUE_OPERATOR_OWNERS: alice)" in refused.error_message


def _queue(
    sessions: sessionmaker[Session],
    store: LocalObjectStore,
    payloads: list[bytes],
    owner: str = "alice",
    owners: list[str] | None = None,
) -> list[uuid.UUID]:
    job_ids = []
    for payload, job_owner in zip(payloads, owners or [owner] * len(payloads), strict=True):
        job_id = uuid.uuid4()
        size = store.put_bytes(payload_key(job_id), payload)
        job = Job(
            id=job_id,
            owner=job_owner,
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
    from nnqueue.workers.job_execution import JobRunner
    from nnqueue.workers.trace_execution import VLLMTraceExecutor  # imports vLLM: only when a test runs

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
