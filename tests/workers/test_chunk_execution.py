"""ChunkRunner on the session's in-process engine with real Postgres, Redis and S3: a chunk's slot is freed as soon
as its shard is handed off (``run_next`` answers while the upload goes on in the chunk's task); an upload that fails
after that sends the chunk back to the queue with the cause and leaves nothing at its key, and the chunk's next
attempt stores the shard that its recorded sha256 describes."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnqueue.broker import queue_name
from nnqueue.db.models import HarvestChunk, JobStatus, utcnow
from nnqueue.engines.builders import BuilderPool
from nnqueue.engines.outbox import OutboxPoller
from nnqueue.scheduler import registry
from nnqueue.storage.s3 import S3ObjectStore
from nnqueue.workers.sinks import ResultSinks
from nnqueue.workers.upload_budget import UploadBudget
from tests.storage.test_object_store import take_the_part_thread
from tests.utils import servers
from tests.utils.engines import InProcessEngine, run
from tests.utils.services import MODEL_KEY, Services
from tests.workers.test_harvest import chunks_of, harvest, prompts, wait_harvest

S = JobStatus
# 4 KiB of float32 a token: a shard of 48 prompts is several parts of a multipart upload.
CAPTURES = [
    {"module": "model.layers.0"},
    {"module": "model.layers.1"},
    {"module": "model.layers.0", "io": "input"},
    {"module": "model.layers.1", "io": "input"},
    {"module": "model.layers.0.mlp.down_proj", "io": "input"},
    {"module": "model.layers.1.mlp.down_proj", "io": "input"},
]


def wait_until(what: str, done: Callable[[], object]) -> None:
    deadline = time.monotonic() + 120
    while not done():
        assert time.monotonic() < deadline, f"{what} did not happen in 120 s"
        time.sleep(0.02)


def the_chunk(services: Services, harvest_id: uuid.UUID) -> HarvestChunk:
    [chunk] = chunks_of(services, harvest_id)
    return chunk


def test_an_upload_that_fails_after_the_slot_was_freed_sends_the_chunk_back_and_stores_nothing(
    inprocess_engine: InProcessEngine, services: Services, tmp_path: Path
) -> None:
    from nnqueue.engines.harvest_runner import capture_points
    from nnqueue.workers.chunk_execution import ChunkRunner
    from nnqueue.workers.job_execution import Outcome

    worker_id = registry.new_worker_id()
    points = run(inprocess_engine, capture_points(inprocess_engine.model.vllm_entrypoint))
    registry.register(services.sessions, worker_id, MODEL_KEY, queue_name(MODEL_KEY), 1, capture_points=points)
    harvest_id = harvest(services, prompts(48, 160, seed=5), prompts_per_chunk=48, captures=CAPTURES)
    assert services.settings.s3 is not None
    store = S3ObjectStore(services.settings.s3.model_copy(update={"upload_parts_in_flight": 1}))
    client = servers.s3_client_for(services.settings.s3)
    runner = ChunkRunner(
        services.sessions,
        services.store,
        services.celery,
        inprocess_engine.model,
        ResultSinks(store, tmp_path, tmp_path),
        MODEL_KEY,
        worker_id,
        max_attempts=3,
        engine_info={},
        uploads=UploadBudget(1 << 30),
    )
    release = take_the_part_thread(store)  # the shard's parts wait for the test

    assert inprocess_engine.run(runner.run_next()) is Outcome.HANDED_OFF  # the slot is free; the shard is not stored
    chunk = the_chunk(services, harvest_id)
    assert chunk.status is S.RUNNING and runner.running_chunks() == [chunk.id]
    [handed_off] = tmp_path.glob("nnqueue-handoff-*/*.safetensors")
    assert handed_off.stat().st_size > 3 * (8 << 20)  # several parts, none read yet
    os.truncate(handed_off, 1 << 20)  # what an engine could do to its file once it had reported it
    release.set()

    wait_until("the chunk's end", lambda: the_chunk(services, harvest_id).status is not S.RUNNING)
    chunk = the_chunk(services, harvest_id)
    assert (chunk.status, chunk.attempts, chunk.sha256) == (S.QUEUED, 1, None)
    # Cut before the worker's check of the file, or after it, as its parts were read:
    assert "handed off with 1048576 bytes" in (chunk.error or "") or "the file ended at byte" in (chunk.error or "")
    assert runner.running_chunks() == [] and not store.exists(chunk.shard_key)
    assert client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []  # aborted, not left over
    assert not any(tmp_path.glob("nnqueue-handoff-*/*"))

    # Its next attempt stores the shard; what is stored is what its recorded size and sha256 say.
    assert inprocess_engine.run(runner.run_next()) is Outcome.HANDED_OFF
    done = wait_harvest(services, harvest_id)
    assert done.status is S.COMPLETED, (done.error_type, done.error_message)
    chunk = the_chunk(services, harvest_id)
    stored = store.get_bytes(chunk.shard_key)
    assert (chunk.attempts, chunk.bytes, chunk.sha256) == (2, len(stored), hashlib.sha256(stored).hexdigest())
    assert runner.running_chunks() == []


def _registered(services: Services, engine: InProcessEngine) -> str:
    """A worker id registered for the model with the engine's capture points (a harvest is checked against them)."""
    from nnqueue.engines.harvest_runner import capture_points

    worker_id = registry.new_worker_id()
    points = run(engine, capture_points(engine.model.vllm_entrypoint))
    registry.register(services.sessions, worker_id, MODEL_KEY, queue_name(MODEL_KEY), 1, capture_points=points)
    return worker_id


def _switching_runner(
    services: Services, engine: InProcessEngine, tmp_path: Path, worker_id: str, *, all_work: bool
) -> tuple[Any, Any]:
    """A ChunkRunner beside a JobRunner whose engine has a switch from trust domain ``owner:mallory`` to
    ``owner:alice`` under way (not yet verified), and whose leaving ``owner:mallory`` fails (builders that could not
    be stopped)."""
    from nnqueue.scheduler.domain_turns import DomainTurns
    from nnqueue.workers.chunk_execution import ChunkRunner
    from nnqueue.workers.job_execution import JobRunner
    from nnqueue.workers.trace_execution import VLLMTraceExecutor

    class LeavingFails(VLLMTraceExecutor):
        async def leave_domain(self) -> None:
            raise OSError("a trace builder could not be stopped")

    sinks = ResultSinks(services.store, tmp_path)
    executor = LeavingFails(
        services.sessions,
        services.store,
        engine.model,
        sinks,
        OutboxPoller(engine.model.vllm_entrypoint),
        BuilderPool("", {}, 0, 0),
    )
    turns = DomainTurns(all_work=all_work)
    jobs = JobRunner(services.sessions, executor, MODEL_KEY, worker_id, turns=turns)

    def trace_of(domain: str, job: str) -> Any:
        return turns.claimed(turns.choose({domain: utcnow()}), [job])

    turns.verified(trace_of("owner:mallory", "mallory's"))  # mallory's trace ran on this engine and ended
    turns.ended("mallory's")
    # alice's trace (the harvests' owner's) is claimed: the switch, which that trace would verify
    assert trace_of("owner:alice", "alice's").previous == "owner:mallory"
    chunks = ChunkRunner(
        services.sessions,
        services.store,
        services.celery,
        engine.model,
        sinks,
        MODEL_KEY,
        worker_id,
        max_attempts=3,
        engine_info={},
        uploads=UploadBudget(1 << 30),
        jobs=jobs,
    )
    return chunks, jobs


def test_a_chunk_waits_for_no_switch_where_turns_cover_traces_only(
    inprocess_engine: InProcessEngine, services: Services, tmp_path: Path
) -> None:
    """NNQUEUE_DOMAIN_SWITCH=verify: a chunk runs no user code, and runs beside a switch of the traces' domain (as a
    steering job does) rather than waiting for, or starting, its verification (a CI run saw a harvest wait 900 s)."""
    from nnqueue.workers.job_execution import Outcome

    worker_id = _registered(services, inprocess_engine)
    harvest_id = harvest(services, prompts(4, 16, seed=1), prompts_per_chunk=4)
    chunks, jobs = _switching_runner(services, inprocess_engine, tmp_path, worker_id, all_work=False)
    assert inprocess_engine.run(chunks.run_next()) is Outcome.HANDED_OFF
    assert jobs.turns.unverified() is not None and jobs._switching is None  # not started by the chunk
    assert wait_harvest(services, harvest_id).status is S.COMPLETED


def test_a_chunk_whose_switch_fails_goes_back_to_the_queue_uncharged(
    inprocess_engine: InProcessEngine, services: Services, tmp_path: Path
) -> None:
    """NNQUEUE_DOMAIN_SWITCH=restart (chunks in the turns): the switch the chunk waits for fails; the chunk is no
    task's, so it goes back to the queue with the cause, its attempt not counted, instead of staying RUNNING (and the
    worker stops for a fresh engine, as for a trace that waited for the switch)."""
    from nnqueue.workers.job_execution import Outcome

    worker_id = _registered(services, inprocess_engine)
    harvest_id = harvest(services, prompts(4, 16, seed=2), prompts_per_chunk=4)
    chunks, _ = _switching_runner(services, inprocess_engine, tmp_path, worker_id, all_work=True)
    assert inprocess_engine.run(chunks.run_next()) is Outcome.SKIPPED
    chunk = the_chunk(services, harvest_id)
    assert (chunk.status, chunk.attempts, chunk.worker_id) == (S.QUEUED, 0, worker_id)
    assert "trust domain 'owner:mallory'" in (chunk.error or "") and "could not be stopped" in (chunk.error or "")
    assert chunks.jobs.turns.ended("alice's")  # the chunk's unit ended with it: nothing else is in flight


def test_a_harvest_whose_chunks_all_completed_is_completed_by_a_heartbeat(
    inprocess_engine: InProcessEngine, services: Services, tmp_path: Path
) -> None:
    """Its worker stopped between the last chunk's end and the manifest (or, before 61's fix, its heartbeat took the
    finishing chunk for lost and cancelled the rest: the CI hangs of stops 59 and 61, a harvest RUNNING for good with
    every chunk COMPLETED): any worker's heartbeat completes it (``ChunkRunner.complete_finished``)."""
    from sqlalchemy import update

    from nnqueue.db.models import Harvest
    from nnqueue.db.session import transaction
    from nnqueue.workers.chunk_execution import ChunkRunner

    worker_id = _registered(services, inprocess_engine)
    harvest_id = harvest(services, prompts(4, 40, seed=7), prompts_per_chunk=4)
    runner = ChunkRunner(
        services.sessions,
        services.store,
        services.celery,
        inprocess_engine.model,
        ResultSinks(services.store, tmp_path),
        MODEL_KEY,
        worker_id,
        max_attempts=3,
        engine_info={},
        uploads=UploadBudget(1 << 30),
    )
    assert runner.complete_finished() == []  # its chunk is still QUEUED
    for _ in range(10):  # the module's earlier tests left chunks in the queue: the runner takes them too
        inprocess_engine.run(runner.run_next())
        wait_until("the runner's chunks' ends", lambda: runner.running_chunks() == [])
        if the_chunk(services, harvest_id).status is S.COMPLETED:
            break
    done = wait_harvest(services, harvest_id)
    assert done.status is S.COMPLETED and done.manifest_key is not None
    services.store.delete(done.manifest_key)
    with transaction(services.sessions) as session:  # as a worker stopped before the manifest leaves it
        session.execute(
            update(Harvest)
            .where(Harvest.id == harvest_id)
            .values(status=S.RUNNING, finished_at=None, manifest_key=None)
        )

    assert runner.complete_finished() == [harvest_id]
    again = wait_harvest(services, harvest_id)
    assert again.status is S.COMPLETED and again.manifest_key == done.manifest_key
    assert services.store.exists(done.manifest_key)
    assert runner.complete_finished() == []
