"""Chaos run (not in CI): a mixed load on two workers while their world breaks, then what became of every job.

Real servers (tests/servers.py: PostgreSQL, Redis, SeaweedFS S3), the HTTP API in this process, and
``--workers`` supervised ``nnqueue worker`` processes for the tiny test model. A submitter sends jobs
through the API: traces that complete (quick ones, and slow ones that a fault can catch running),
traces whose code raises (they fail), and slow traces it cancels a moment later. Meanwhile the chaos thread SIGKILLs a worker process ``--kills`` times (its supervisor
restarts it), restarts Redis empty, restarts PostgreSQL, and stops S3 for ``--outage-s``. Then it waits
for every accepted job to end and prints: jobs accepted (201) and refused, completed, failed by cause,
cancelled, run more than once, completed more than once, stuck (not ended), and the time from the last
fault to the last job ending.

The target: every accepted job ends (completed, or failed with a cause), none completes twice, none is
stuck. Run ``python benchmarks/chaos.py --help`` for the scale flags; ``--jobs 40 --kills 4`` takes
about ten minutes on two cores.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nnqueue.api import auth
from nnqueue.db import migrate
from nnqueue.db.models import Job, JobEvent, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.embedded import ApiServer, ChildProcess
from nnqueue.settings import S3Settings, Settings
from tests.utils import servers
from tests.utils.payloads import PayloadBackend, slow_payload, two_invoke_payload
from tests.utils.services import ENGINE_ARGS
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

MODEL_KEY = "chaos-tiny"
TERMINAL = {JobStatus.COMPLETED.value, JobStatus.FAILED.value, JobStatus.CANCELLED.value}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def failing_payload(client: Any) -> bytes:
    backend = PayloadBackend()
    with client.trace("The job that fails", temperature=0.0, max_tokens=1, backend=backend):
        hidden = client.model.layers[0].output[0]
        raise ValueError("this trace fails on purpose")
    return backend.payload


def restart(
    process: ChildProcess, cwd: Path, *, down_s: float = 0.0, env: dict[str, str] | None = None, user: str | None = None
) -> ChildProcess:
    """Stop a server (keeping its data directory) and start it again with the same command line."""
    argv = [str(arg) for arg in process.process.args]
    ChildProcess.stop(process, grace=10)
    for port_socket in glob.glob("/tmp/seaweedfs-*.sock"):
        if any(arg.endswith(port_socket.rsplit("-", 1)[1].removesuffix(".sock")) for arg in argv):
            Path(port_socket).unlink(missing_ok=True)
    time.sleep(down_s)
    fresh = ChildProcess(
        process.name, argv, process.log_path, env=env, cwd=cwd, stop_signal=process.stop_signal, user=user
    )
    return fresh


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = Path(tempfile.mkdtemp(prefix="nnqueue-chaos-"))
        log(f"servers and logs under {self.base}")
        self.postgres, self.redis, self.s3 = servers.start_postgres(), servers.start_redis(), servers.start_s3()
        self.workdirs = {
            name: server.process.workdir
            for name, server in (("postgres", self.postgres), ("redis", self.redis), ("s3", self.s3))
        }
        migrate.upgrade(self.postgres.url)
        s3 = S3Settings(
            endpoint_url=self.s3.endpoint_url,
            bucket="chaos",
            region=self.s3.region,
            access_key_id=self.s3.access_key_id,
            secret_access_key=self.s3.secret_access_key,
        )
        self.env = {
            "NNQUEUE_DATABASE_URL": self.postgres.url,
            "NNQUEUE_BROKER_URL": self.redis.url,
            "NNQUEUE_S3__ENDPOINT_URL": s3.endpoint_url or "",
            "NNQUEUE_S3__BUCKET": s3.bucket,
            "NNQUEUE_S3__REGION": s3.region,
            "NNQUEUE_S3__ACCESS_KEY_ID": s3.access_key_id or "",
            "NNQUEUE_S3__SECRET_ACCESS_KEY": self.s3.secret_access_key,
            "NNQUEUE_WORKER_HEARTBEAT_S": "1",
            "NNQUEUE_WORKER_STALE_AFTER_S": "8",
            "NNQUEUE_BROKER_VISIBILITY_TIMEOUT_S": "900",
        }
        self.settings = Settings(
            _env_file=None,
            database_url=self.postgres.url,
            broker_url=self.redis.url,
            s3=s3,
            worker_stale_after_s=8,
            worker_heartbeat_s=1,
        )
        self.sessions = session_factory(make_engine(self.postgres.url))
        with transaction(self.sessions) as session:
            _, secret = auth.create_key(session, "chaos", ["trace", "admin"])
        self.headers = {"Authorization": f"Bearer {secret}"}
        self.api = ApiServer(self.settings)
        self.workers = [self.start_worker(index) for index in range(args.workers)]
        self.accepted: list[str] = []
        self.refused: collections.Counter[str] = collections.Counter()
        self.faults_done, self.finished = threading.Event(), threading.Event()
        self.last_fault = time.monotonic()

    def start_worker(self, index: int) -> ChildProcess:
        argv = [sys.executable, "-m", "nnqueue", "worker", "--model", str(self.args.model), "--model-key", MODEL_KEY]
        argv += ["--max-concurrent-jobs", "4", *ENGINE_ARGS]
        env = {**os.environ, **self.env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        return ChildProcess(f"worker-{index}", argv, self.base / f"worker-{index}.log", env=env)

    def wait_for_workers(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.api.url}/v1/models", headers=self.headers)
            models = {model["model_key"]: model["workers"] for model in response.json().get("models", [])}
            if models.get(MODEL_KEY, 0) >= len(self.workers):
                return
            time.sleep(1)
        raise RuntimeError(f"workers did not register in {timeout} s; see {self.base}")

    # --- load --------------------------------------------------------------------------------

    def submit(self, payload: bytes) -> str | None:
        spec = json.dumps({"model_key": MODEL_KEY, "timeout_s": 300})
        try:
            response = httpx.post(
                f"{self.api.url}/v1/jobs",
                headers=self.headers,
                data={"spec": spec},
                files={"payload": ("t", payload)},
                timeout=60,
            )
        except httpx.HTTPError as error:
            self.refused[type(error).__name__] += 1
            return None
        if response.status_code != 201:
            self.refused[str(response.status_code)] += 1
            return None
        job_id = response.json()["id"]
        self.accepted.append(job_id)
        return job_id

    def cancel_later(self, job_id: str, delay: float) -> None:
        def cancel() -> None:
            time.sleep(delay)
            try:
                httpx.post(f"{self.api.url}/v1/jobs/{job_id}/cancel", headers=self.headers, timeout=60)
            except httpx.HTTPError:
                pass

        threading.Thread(target=cancel, daemon=True).start()

    def load(self, payloads: dict[str, bytes]) -> None:
        kinds = ["good", "slow"] * 3 + ["failing"] * 2 + ["cancelled"] * 2
        for index in range(self.args.jobs):
            kind = kinds[index % len(kinds)]
            job_id = self.submit(payloads[kind])
            if job_id is not None and kind == "cancelled":
                self.cancel_later(job_id, random.uniform(0.5, 5))
            time.sleep(self.args.submit_interval_s)

    # --- faults ------------------------------------------------------------------------------

    def kill_a_worker(self) -> None:
        supervisor = random.choice(self.workers)
        children = [child for child in psutil.Process(supervisor.pid).children() if "--no-supervise" in child.cmdline()]
        if children:
            log(f"SIGKILL worker process {children[0].pid}")
            children[0].kill()

    def faults(self) -> None:
        events = [("kill", i) for i in range(self.args.kills)] + [("redis", 0), ("postgres", 0), ("s3", 0)]
        random.shuffle(events)
        gap = self.args.jobs * self.args.submit_interval_s / (len(events) + 1)
        for kind, _ in events:
            time.sleep(gap)
            if kind == "kill":
                self.kill_a_worker()
            elif kind == "redis":
                log("Redis restarts, empty")
                self.redis.process = restart(self.redis.process, self.workdirs["redis"])
            elif kind == "postgres":
                log("PostgreSQL restarts")
                user = servers.POSTGRES_USER_WHEN_ROOT if os.geteuid() == 0 else None
                self.postgres.process = restart(self.postgres.process, self.workdirs["postgres"], down_s=2, user=user)
            else:
                log(f"S3 is down for {self.args.outage_s:g} s")
                workdir = self.workdirs["s3"]
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), "TMPDIR": str(workdir)}
                self.s3.process = restart(self.s3.process, workdir, down_s=self.args.outage_s, env=env)
            self.last_fault = time.monotonic()
        self.faults_done.set()
        # The restarted servers die with the thread that started them (PR_SET_PDEATHSIG): stay alive.
        self.finished.wait()

    # --- outcome -----------------------------------------------------------------------------

    def statuses(self) -> dict[str, Job]:
        with self.sessions() as session:
            jobs = session.scalars(select(Job).where(Job.id.in_(self.accepted))).all()
            return {str(job.id): job for job in jobs}

    def wait_for_the_end(self) -> float | None:
        deadline = time.monotonic() + self.args.recovery_timeout_s
        while time.monotonic() < deadline:
            try:
                jobs = self.statuses()
            except Exception:  # noqa: BLE001 - the database may be restarting
                time.sleep(2)
                continue
            if len(jobs) == len(self.accepted) and all(job.status.value in TERMINAL for job in jobs.values()):
                return time.monotonic() - self.last_fault
            time.sleep(2)
        return None

    def entries(self, status: JobStatus) -> dict[Any, int]:
        """How many times each accepted job entered ``status``, from its history."""
        with self.sessions() as session:
            rows = session.execute(
                select(JobEvent.job_id, func.count())
                .where(JobEvent.to_status == status, JobEvent.job_id.in_(self.accepted))
                .group_by(JobEvent.job_id)
            ).all()
        return {job_id: count for job_id, count in rows}

    def report(self, recovered_after: float | None) -> None:
        jobs = self.statuses()
        starts, completions = self.entries(JobStatus.RUNNING), self.entries(JobStatus.COMPLETED)
        by_status = collections.Counter(job.status.value for job in jobs.values())
        causes = collections.Counter(job.error_type for job in jobs.values() if job.status is JobStatus.FAILED)
        stuck = [job_id for job_id in self.accepted if job_id not in jobs or jobs[job_id].status.value not in TERMINAL]
        print("\n=== chaos run ===")
        print(
            f"workers {self.args.workers}, kills {self.args.kills}, Redis restarted empty, PostgreSQL restarted, S3 down {self.args.outage_s:g} s"
        )
        print(f"jobs accepted        {len(self.accepted)}  (refused: {dict(self.refused) or 0})")
        print(f"completed            {by_status.get('completed', 0)}")
        print(f"failed               {by_status.get('failed', 0)}  causes: {dict(causes)}")
        print(f"cancelled            {by_status.get('cancelled', 0)}")
        print(f"run more than once   {sum(1 for count in starts.values() if count > 1)}")
        print(f"completed twice     {sum(1 for count in completions.values() if count > 1)}")
        stuck_statuses = collections.Counter(
            jobs[job_id].status.value if job_id in jobs else "missing" for job_id in stuck
        )
        print(f"stuck (not ended)    {len(stuck)}  {dict(stuck_statuses)}  {stuck[:5]}")
        recovery = f"{recovered_after:.0f} s" if recovered_after is not None else "not within the timeout"
        print(f"time to recover      {recovery} (from the last fault to the last job ended)")

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop(grace=60)
        self.api.stop()
        for server in (self.s3, self.redis, self.postgres):
            server.stop()
        self.finished.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40, help="jobs submitted (default 40)")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of a worker process (default 20)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--submit-interval-s", type=float, default=2.0)
    parser.add_argument("--outage-s", type=float, default=15.0, help="how long S3 is down")
    parser.add_argument("--recovery-timeout-s", type=float, default=900.0)
    parser.add_argument("--model", type=Path, help="model directory (default: the tests' tiny Llama, built once)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)

    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()
    if args.model is None:
        from tests.utils.tiny_model import build_tiny_llama

        args.model = build_tiny_llama(Path(tempfile.gettempdir()) / "nnqueue-chaos-tiny-llama")
    client = VLLM(str(args.model), **TINY_ENGINE_KWARGS)
    payloads = {
        "good": two_invoke_payload(client),
        "slow": slow_payload(client, 30),  # about 3 s on the engine: long enough for a fault to catch it running
        "failing": failing_payload(client),
        "cancelled": slow_payload(client, 100),
    }

    chaos = Chaos(args)
    try:
        chaos.wait_for_workers()
        log(f"{args.workers} workers up; {args.jobs} jobs, {args.kills} kills, Redis, PostgreSQL and S3 faults")
        faults = threading.Thread(target=chaos.faults, daemon=True)
        faults.start()
        chaos.load(payloads)
        chaos.faults_done.wait()
        log("faults done; waiting for every accepted job to end")
        chaos.report(chaos.wait_for_the_end())
    finally:
        chaos.stop()


if __name__ == "__main__":
    main()
