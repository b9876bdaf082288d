"""One test module's view of the suite's servers, and ``nnqueue worker`` processes on it.

A :class:`Services` is a service namespace of its own (a fresh migrated database, a Redis database
number, an S3 bucket), so a module's worker never sees another module's jobs; the ``services`` and
``start_worker`` fixtures (tests/conftest.py) build them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.broker import create_celery_app
from nnqueue.db.models import Job, JobStatus, Worker
from nnqueue.db.session import make_engine, session_factory
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.scheduler.submission import submit_job
from nnqueue.settings import S3Settings, Settings
from nnqueue.storage import object_store_from_settings
from nnqueue.storage.object_store import ObjectStore
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

MODEL_KEY = "tiny-llama"
ENGINE_ARGS = [f"--{name.replace('_', '-')}={value}" for name, value in TINY_ENGINE_KWARGS.items()]


class Services:
    """One module's view of the servers: settings for the test process and env for worker processes."""

    def __init__(self, database_url: str, redis_url: str, s3: S3Settings) -> None:
        self.env = {
            "NNQUEUE_DATABASE_URL": database_url,
            "NNQUEUE_BROKER_URL": redis_url,
            "NNQUEUE_S3__ENDPOINT_URL": s3.endpoint_url or "",
            "NNQUEUE_S3__BUCKET": s3.bucket,
            "NNQUEUE_S3__REGION": s3.region,
            "NNQUEUE_S3__ACCESS_KEY_ID": s3.access_key_id or "",
            "NNQUEUE_S3__SECRET_ACCESS_KEY": s3.secret_access_key.get_secret_value() if s3.secret_access_key else "",
            # Fast failure detection, so the redelivery test runs in seconds.
            "NNQUEUE_WORKER_HEARTBEAT_S": "0.5",
            "NNQUEUE_WORKER_STALE_AFTER_S": "3",
            "NNQUEUE_ENGINE_STALL_TIMEOUT_S": "3",
        }
        self.settings = Settings(
            _env_file=None,
            database_url=database_url,
            broker_url=redis_url,
            s3=s3,
            worker_heartbeat_s=0.5,
            worker_stale_after_s=3,
        )
        self.sessions: sessionmaker[Session] = session_factory(make_engine(database_url))
        self.store: ObjectStore = object_store_from_settings(self.settings)
        self.celery = create_celery_app(self.settings)
        self.admission = AdmissionPolicy.from_settings(self.settings)

    def submit(self, payload: bytes, *, owner: str = "alice", model_key: str = MODEL_KEY, **options: Any) -> Job:
        """``submit_job`` on these services, admission included, as the API submits (``options``: timeout_s, meta...)."""
        return submit_job(
            self.sessions,
            self.store,
            self.celery,
            admission=self.admission,
            owner=owner,
            model_key=model_key,
            payload=payload,
            **options,
        )

    def job(self, job_id: uuid.UUID) -> Job:
        with self.sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job

    def wait_for(self, job_id: uuid.UUID, statuses: set[JobStatus], timeout: float = 120) -> Job:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.status in statuses:
                return job
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} still {self.job(job_id).status} after {timeout} s, wanted {statuses}")


class WorkerProcess:
    """``nnqueue worker`` in a subprocess of its own process group, logging to a file."""

    def __init__(
        self,
        services: Services,
        model_path: Path,
        log_path: Path,
        max_concurrent_jobs: int | None = 4,
        env: dict[str, str] | None = None,
        *,
        engine_args: Sequence[str] = (),
        model_key: str = MODEL_KEY,
        engine: str = "vllm",
        cwd: Path | None = None,
        user: str | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        """``engine``: ``vllm`` (the tiny model's engine arguments) or ``transformers`` (one job at a time);
        ``env`` adds to the module's service settings; ``user`` runs the worker as that account;
        ``max_concurrent_jobs`` None: the worker's default; ``engine_args`` go after the tiny model's;
        ``wrapper``: a command that runs the worker's command line (its arguments) in another layout."""
        self.services, self.log_path, self.env = services, log_path, env or {}
        command = [*wrapper, sys.executable, "-m", "nnqueue", "worker", "--model", str(model_path)]
        command += ["--model-key", model_key]
        if engine == "vllm":
            if max_concurrent_jobs is not None:
                command += ["--max-concurrent-jobs", str(max_concurrent_jobs)]
            command += [*ENGINE_ARGS, *engine_args]
        else:
            command += ["--engine", engine]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **services.env, **(env or {})},
                cwd=cwd,
                user=user,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_registered(self, timeout: float = 600) -> Worker:
        """The worker's row once it has registered: its engine and trace builders loaded (minutes on a loaded machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log()[-5000:]}")
            # `nnqueue worker` supervises the worker process: the registered pid is a child's.
            pids = [self.process.pid, *(child.pid for child in self.children())]
            with self.services.sessions() as session:
                worker = session.scalar(
                    select(Worker)
                    .where(Worker.pid.in_(pids), Worker.stopped_at.is_(None))
                    .order_by(Worker.started_at.desc())
                )
            if worker is not None:
                return worker
            time.sleep(0.5)
        raise AssertionError(f"worker did not register in {timeout} s:\n{self.log()[-5000:]}")

    def wait_log(self, text: str, timeout: float = 60, after: int = 0) -> None:
        """Until ``text`` is in the log past its first ``after`` characters."""
        deadline = time.monotonic() + timeout
        while text not in self.log()[after:]:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the worker log after {timeout} s:\n{self.log()[-5000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the worker (its supervisor, whose death the kernel passes on to the worker process
        as a SIGKILL), as the OOM killer would; its engine process is not told."""
        self.process.kill()
        self.process.wait(timeout=60)

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=60)
