"""Submission rate of ``POST /v1/jobs`` against real Postgres, Redis and S3, beside a bare FastAPI endpoint.

Starts the test suite's servers (tests/servers.py: Postgres, Redis, SeaweedFS S3), migrates a database,
registers a live worker row and an API key, and serves two apps the same way (uvicorn, ``--workers W``):

* nnqueue: ``nnqueue serve-api`` (the real command) taking real submissions of a 64-byte payload and a spec:
  as the Python client sends them (the payload as the body, the spec in the ``Nnqueue-Spec`` header), and as a
  multipart form (``nnqueue-form``: what browsers, curl and older clients send);
* bare: a FastAPI app whose one endpoint only inserts a row (SQLAlchemy, the same engine settings) and
  answers its id; it receives the client's requests and does not parse them.

Each is driven by C concurrent clients (aiohttp, in this process) for D seconds, C in 1 and 64; the script
prints jobs/s, p50 and p99 latency for each, the CPU time the app's processes spent per request (steadier
than rates on a shared machine), and nnqueue's rate as a fraction of the bare one. No worker consumes the
queue; before each measurement the jobs still QUEUED are marked cancelled, as if workers had run them: a
submission's answer counts the jobs ahead of it, and its admission the key's jobs in flight (the per-key limit
is lifted for the run), so a queue left growing would charge each measurement for the ones before it.

    .venv/bin/python benchmarks/submit_rate.py [--seconds 5] [--workers 2] [--concurrency 1 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import psutil
from pydantic import SecretStr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, update

from nnqueue import trace_payload
from nnqueue.api import auth
from nnqueue.db import migrate
from nnqueue.db.models import Job, JobStatus, utcnow
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler import registry
from nnqueue.settings import S3Settings
from tests.utils import servers

MODEL_KEY = "bench-model"
# 64 bytes that start like an nnsight serialized trace (the API refuses anything else, without unpickling).
PAYLOAD = trace_payload.PICKLE_PROTOCOL_4 + (52).to_bytes(8, "little") + b"p" * 52
BARE_APP = textwrap.dedent(
    """
    import os, uuid
    from datetime import UTC, datetime
    from fastapi import FastAPI
    from sqlalchemy import Column, DateTime, MetaData, Table, Uuid, insert
    from nnqueue.db.session import make_engine

    engine = make_engine(os.environ["NNQUEUE_DATABASE_URL"])
    rows = Table("bare_rows", MetaData(), Column("id", Uuid, primary_key=True), Column("at", DateTime(timezone=True)))
    app = FastAPI()

    @app.post("/bare", status_code=201)
    def bare() -> dict:
        row_id = uuid.uuid4()
        with engine.begin() as connection:
            connection.execute(insert(rows).values(id=row_id, at=datetime.now(UTC)))
        return {"id": str(row_id)}
    """
)


@dataclass
class Result:
    name: str
    concurrency: int
    requests: int
    seconds: float
    latencies: list[float]
    errors: int
    server_cpu_s: float = 0.0

    def line(self) -> str:
        ordered = sorted(self.latencies)
        p50 = statistics.median(ordered) * 1000 if ordered else float("nan")
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000 if ordered else float("nan")
        cpu = 1000 * self.server_cpu_s / max(1, self.requests)
        return (
            f"{self.name:12} C={self.concurrency:<3} {self.rate:8.1f} jobs/s   p50 {p50:7.1f} ms   p99 {p99:7.1f} ms"
            f"   server CPU {cpu:5.2f} ms/job   errors {self.errors}"
        )

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def serve(argv: list[str], env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise SystemExit(f"{argv} exited:\n{log.read_text()[-3000:]}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=2)
            return process
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{argv} did not answer in 120 s") from None
            time.sleep(0.2)


def stop(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=30)


def cpu_seconds(process: subprocess.Popen[bytes]) -> float:
    """User and system CPU time of a server and its worker processes so far."""
    root = psutil.Process(process.pid)
    total = 0.0
    for member in [root, *root.children(recursive=True)]:
        try:
            times = member.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def drain(engine: Engine) -> None:
    """Mark the jobs still QUEUED cancelled, as if workers had taken them (see the module doc)."""
    with engine.begin() as connection:
        ended = {"status": JobStatus.CANCELLED, "finished_at": utcnow()}
        connection.execute(update(Job).where(Job.status == JobStatus.QUEUED).values(ended))


def measure(server: subprocess.Popen[bytes], *args: object) -> Result:
    """Drive ``server`` (see :func:`drive`) and charge it the CPU time its processes spent meanwhile."""
    before = cpu_seconds(server)
    result = asyncio.run(drive(*args))  # type: ignore[arg-type]
    result.server_cpu_s = cpu_seconds(server) - before
    return result


async def drive(url: str, headers: dict[str, str], concurrency: int, seconds: float, name: str) -> Result:
    """``concurrency`` clients submitting one after another for ``seconds``: as a form when ``name`` ends in
    ``-form``, otherwise as the Python client does."""
    spec = json.dumps({"model_key": MODEL_KEY})
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    raw = {"Content-Type": "application/octet-stream", "Nnqueue-Spec": spec}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def one() -> None:
            nonlocal errors
            body: bytes | aiohttp.FormData = PAYLOAD
            if name.endswith("-form"):
                body = aiohttp.FormData()
                body.add_field("spec", spec)
                body.add_field("payload", PAYLOAD, filename="trace.bin", content_type="application/octet-stream")
            started = time.perf_counter()
            async with session.post(url, data=body, headers=None if name.endswith("-form") else raw) as response:
                await response.read()
                if response.status != 201:
                    errors += 1
                    if errors <= 3:
                        print(f"  {name}: {response.status} {(await response.text())[:200]}")
                    return
            latencies.append(time.perf_counter() - started)

        for _ in range(min(concurrency, 8)):  # warm connections and caches
            await one()
        latencies.clear()
        end = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < end:
                await one()

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return Result(name, concurrency, len(latencies), elapsed, latencies, errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each measurement drives its app")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn processes of each app")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()

    postgres, redis_server, s3 = servers.start_postgres(), servers.start_redis(), servers.start_s3()
    workdir = Path(tempfile.mkdtemp(prefix="nnqueue-submit-rate-"))
    started: list[subprocess.Popen[bytes]] = []
    try:
        migrate.upgrade(postgres.url)
        sessions = session_factory(make_engine(postgres.url))
        with transaction(sessions) as session:
            _, secret = auth.create_key(session, "bench", ["trace"])
        registry.register(sessions, registry.new_worker_id(), MODEL_KEY, "bench-queue", 64)
        with make_engine(postgres.url).begin() as connection:
            connection.exec_driver_sql("CREATE TABLE bare_rows (id uuid PRIMARY KEY, at timestamptz)")
        s3_settings = S3Settings(
            endpoint_url=s3.endpoint_url,
            bucket=f"bench-{uuid.uuid4().hex[:8]}",
            region=s3.region,
            access_key_id=s3.access_key_id,
            secret_access_key=SecretStr(s3.secret_access_key),
        )
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "NNQUEUE_DATABASE_URL": postgres.url,
            "NNQUEUE_BROKER_URL": redis_server.url,
            "NNQUEUE_S3__ENDPOINT_URL": s3_settings.endpoint_url or "",
            "NNQUEUE_S3__BUCKET": s3_settings.bucket,
            "NNQUEUE_S3__REGION": s3_settings.region,
            "NNQUEUE_S3__ACCESS_KEY_ID": s3_settings.access_key_id or "",
            "NNQUEUE_S3__SECRET_ACCESS_KEY": s3.secret_access_key,
            "NNQUEUE_WORKER_STALE_AFTER_S": "86400",
            "NNQUEUE_MAX_JOBS_IN_FLIGHT_PER_KEY": str(10**9),
            "NNQUEUE_MAX_JOBS_IN_FLIGHT_PER_OWNER": str(10**9),
        }
        (workdir / "bare_app.py").write_text(BARE_APP)
        api_port, bare_port = servers.free_ports(2)
        workers = str(args.workers)
        api = serve(
            [sys.executable, "-m", "nnqueue", "serve-api", "--port", str(api_port), "--workers", workers],
            env,
            api_port,
            workdir / "api.log",
        )
        started.append(api)
        bare_argv = [sys.executable, "-m", "uvicorn", "bare_app:app", "--port", str(bare_port), "--workers", workers]
        bare = serve([*bare_argv, "--app-dir", str(workdir)], env, bare_port, workdir / "bare.log")
        started.append(bare)

        headers = {"Authorization": f"Bearer {secret}"}
        print(
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; {args.workers} uvicorn workers each"
        )
        jobs_url, engine = f"http://127.0.0.1:{api_port}/v1/jobs", make_engine(postgres.url)
        for concurrency in args.concurrency:
            results = []
            for name in ("nnqueue", "nnqueue-form"):
                drain(engine)
                results.append(measure(api, jobs_url, headers, concurrency, args.seconds, name))
            base = measure(bare, f"http://127.0.0.1:{bare_port}/bare", headers, concurrency, args.seconds, "bare")
            for result in (*results, base):
                print(result.line())
            ratios = ", ".join(f"{result.name} / bare = {result.rate / base.rate:.2f}" for result in results)
            print(f"{'':12} C={concurrency:<3} {ratios}")
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        for process in started:
            stop(process)
        for server in (postgres, redis_server, s3):
            server.stop()


if __name__ == "__main__":
    main()
