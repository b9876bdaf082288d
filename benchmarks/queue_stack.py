"""A real queue for the CPU benchmarks that measure scheduling (fair_share.py, trust_domains.py): the test suite's
servers (PostgreSQL, Redis, SeaweedFS S3; tests/utils/servers.py), migrated, the tiny Llama, and ``nnqueue worker``
processes on it, started from this tree or from another (an older nnqueue, for a "before" row). Jobs go in through
``submit_job`` (admission, the owner's trust domain, tokens), and their times are read from their own rows."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nnsight.modeling.vllm import VLLM
from pydantic import SecretStr

from nnqueue.api import auth
from nnqueue.db import migrate
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import transaction
from nnqueue.engines.platform import prepare_process
from nnqueue.scheduler.trust_domains import join_group, leave_group
from nnqueue.settings import S3Settings
from tests.utils import servers
from tests.utils.payloads import PROMPTS, PrebuiltBackend
from tests.utils.services import Services, WorkerProcess
from tests.utils.tiny_model import TINY_ENGINE_KWARGS, build_tiny_llama

ENDED = {JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class QueueStack:
    """Servers, a migrated database, the tiny model and its meta model for building payloads; ``close`` stops all."""

    def __init__(self, model_path: Path | None = None, engine_args: tuple[str, ...] = ()) -> None:
        """``model_path``: a local model folder (default: the tiny Llama, built here); ``engine_args``: the worker's
        vLLM arguments after the tiny model's (``--dtype=bfloat16``, ``--load-format=dummy``, ...)."""
        prepare_process()
        self.work = Path(tempfile.mkdtemp(prefix="nnqueue-bench-"))
        self.model_path = model_path or build_tiny_llama(self.work / "tiny-llama")
        self.engine_args = engine_args
        self.client = VLLM(str(self.model_path), **TINY_ENGINE_KWARGS)
        self.postgres, self.redis, self.s3 = servers.start_postgres(), servers.start_redis(), servers.start_s3()
        migrate.upgrade(self.postgres.url)
        self.services = Services(
            self.postgres.url,
            self.redis.url,
            S3Settings(
                endpoint_url=self.s3.endpoint_url,
                bucket="bench",
                region=self.s3.region,
                access_key_id=self.s3.access_key_id,
                secret_access_key=SecretStr(self.s3.secret_access_key),
            ),
        )
        self.workers: list[WorkerProcess] = []

    def worker(
        self, model_key: str, concurrency: int, tree: Path | None = None, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        """A registered worker of the tiny model under ``model_key``, past its first jobs; ``tree``: run that nnqueue
        instead of this one (the worker's working folder, which Python searches first). Its trust-domain switches
        verify the live engine unless ``env`` says otherwise: the benchmarks of several owners (fair share, hostile
        keys) measure the scheduling and the engine's recovery, not a fresh engine at every owner's turn
        (``trust_domains.py --domain-switch restart`` measures that)."""
        started = time.monotonic()
        log_path = self.work / f"worker-{model_key}.log"
        worker = WorkerProcess(
            self.services,
            self.model_path,
            log_path,
            concurrency,
            {"NNQUEUE_DOMAIN_SWITCH": "verify", **(env or {})},
            engine_args=self.engine_args,
            model_key=model_key,
            cwd=tree,
        )
        self.workers.append(worker)
        worker.wait_registered(timeout=1800)  # a loaded machine takes minutes
        # Its first jobs start the trace builders and warm the engine up (a minute and more here): not measured.
        self.wait_all([self.submit(one_step_payload(self.client), "warm-up", model_key) for _ in range(2)])
        log(
            f"worker for {model_key} ({'tree ' + str(tree) if tree else 'this tree'}) up in {time.monotonic() - started:.0f} s"
        )
        return worker

    def owner(self, name: str) -> None:
        """An owner with a key (a trust domain's member must have one)."""
        with transaction(self.services.sessions) as session:
            auth.create_key(session, name, ["trace"])

    def group(self, owners: tuple[str, ...], together: bool) -> None:
        """Put ``owners`` in one trust domain ("bench-lab"), or each back in their own (NNQUEUE_TRUST_DOMAINS=owner)."""
        with transaction(self.services.sessions) as session:
            for owner in owners:
                if together:
                    join_group(session, owner, "bench-lab", "owner")
                else:
                    leave_group(session, owner, "owner")

    def submit(self, payload: bytes, owner: str, model_key: str) -> uuid.UUID:
        return self.services.submit(payload, owner=owner, model_key=model_key, timeout_s=1800).id

    def ended(self, job_ids: list[uuid.UUID], timeout: float = 3600) -> list[Job]:
        """The jobs once all have ended, whatever their status (as they are, should ``timeout`` pass first)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.services.sessions() as session:
                jobs = [session.get(Job, job_id) for job_id in job_ids]
            found = [job for job in jobs if job is not None]
            assert len(found) == len(job_ids), "a submitted job has no row"
            if all(job.status in ENDED for job in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def wait_all(self, job_ids: list[uuid.UUID], timeout: float = 3600) -> list[Job]:
        """The jobs once all have ended (each COMPLETED, or an AssertionError naming the first that is not)."""
        jobs = self.ended(job_ids, timeout)
        assert all(job.status in ENDED for job in jobs), "jobs did not end in time"
        for job in jobs:
            assert job.status is JobStatus.COMPLETED, (job.error_type, job.error_message)
        return jobs

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        for server in (self.postgres, self.redis, self.s3):
            server.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def one_step_payload(client: VLLM, prompt: str = PROMPTS[1]) -> bytes:
    """A one-prompt trace of one step that saves the logits: the innocent user's job."""
    backend = PrebuiltBackend()
    with client.trace(prompt, temperature=0.0, max_tokens=1, backend=backend):
        logits = client.logits.save()
    return backend.payload


def generation_payload(client: VLLM, tokens: int, prompt: str = PROMPTS[0]) -> bytes:
    """A one-prompt trace generating ``tokens`` tokens that saves the first layer's output and the logits (the
    worker throughput benchmark's job)."""
    backend = PrebuiltBackend()
    with client.trace(prompt, temperature=0.0, max_tokens=tokens, ignore_eos=True, backend=backend):
        hidden = client.model.layers[0].output[0].save()
        logits = client.logits.save()
    return backend.payload


def waited_s(job: Job) -> float:
    """From the job's submission to its start."""
    assert job.started_at is not None
    return (job.started_at - job.created_at).total_seconds()


def latency_s(job: Job) -> float:
    """From the job's submission to its end."""
    assert job.finished_at is not None
    return (job.finished_at - job.created_at).total_seconds()


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 (the largest, below 100 values)."""
    ranked = sorted(values)
    return {"p50": statistics.median(ranked), "p99": ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]}


def baseline_tree(revision: str) -> Path:
    """``revision``'s nnqueue package, extracted from this checkout's git history (``git archive``) to a temporary
    folder: what a worker of that version runs."""
    target = Path(tempfile.mkdtemp(prefix=f"nnqueue-{revision[:12]}-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "nnqueue"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target
