"""A trace that kills the engine fails alone; the jobs it shared the engine with complete, and the
worker (restarted by its supervisor) serves again (nnqueue.workers.engine_health, supervisor). While it
restarts, jobs for the model are accepted and queued (the restart grace), and the crash counts against the
owner whose trace caused it (the crash cool-down)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import torch
from nnsight.modeling.vllm import VLLM

from nnqueue.api import auth
from nnqueue.db.models import JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler import registry
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.scheduler.crash_cooldown import CrashCooldown
from nnqueue.scheduler.submission import submit_job
from tests.utils.payloads import PayloadBackend, slow_payload, two_invoke_payload
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

pytestmark = pytest.mark.slow  # a real worker process whose engine dies twice

S = JobStatus


def engine_killing_payload(client: VLLM) -> bytes:
    """Replaces the storage of layer 0's KV cache (which no guard keeps: every step writes it): vLLM's own forward
    then fails in the engine core, also when the step runs again without the trace (a malformed intervention such
    as a wrong-shape ``.skip()`` no longer kills the engine: tests/engines/test_step_recovery.py)."""
    backend = PayloadBackend()
    with client.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].self_attn.attn.kv_cache.set_(torch.zeros(1))
    return backend.payload


def submit(services: Services, payload: bytes, owner: str, api_key_id: int | None = None) -> uuid.UUID:
    return services.submit(payload, owner=owner, timeout_s=300, api_key_id=api_key_id).id


def key_id(services: Services, owner: str) -> int:
    with transaction(services.sessions) as session:
        key, _ = auth.create_key(session, owner, ["trace"])
        return key.id


def wait_until_no_live_worker(services: Services, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with services.sessions() as session:
            if not registry.live_workers(session, services.settings.worker_stale_after_s):
                return
        assert time.monotonic() < deadline, "the crashed worker still looks live"
        time.sleep(0.1)


def test_the_trace_that_kills_the_engine_fails_alone_and_the_worker_serves_again(
    services: Services, start_worker: Callable[..., WorkerProcess], client_model: VLLM
) -> None:
    worker = start_worker(max_concurrent_jobs=4)
    others = [submit(services, slow_payload(client_model, steps=20), owner) for owner in ("alice", "bob")]
    for job_id in others:
        services.wait_for(job_id, {S.RUNNING})
    mallory = key_id(services, "mallory")
    culprit = submit(services, engine_killing_payload(client_model), "mallory", mallory)

    failed = services.wait_for(culprit, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
    assert failed.status is S.FAILED and failed.error_type == "EngineCrash", (failed.error_type, failed.error_message)
    assert "crashed the engine" in failed.error_message, failed.error_message
    for job_id in others:
        done = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
        assert done.status is S.COMPLETED, (done.error_type, done.error_message)

    # The crash is the key's: with a limit of one crash, its next trace is refused for the cool-down.
    strict = AdmissionPolicy.from_settings(services.settings.model_copy(update={"engine_crash_limit": 1}))
    with pytest.raises(CrashCooldown, match="crashed the engine, stalled it or changed its state 1 times"):
        submit_job(
            services.sessions,
            services.store,
            services.celery,
            admission=strict,
            owner="mallory",
            api_key_id=mallory,
            model_key=MODEL_KEY,
            payload=two_invoke_payload(client_model),
        )

    # While the supervisor restarts the worker, a job for the model is accepted and queued, not refused.
    wait_until_no_live_worker(services)
    during_restart = submit(services, two_invoke_payload(client_model), "alice")
    assert services.job(during_restart).status is S.QUEUED
    fresh = worker.wait_registered(timeout=300)  # the supervisor's fresh worker
    restart_s = (fresh.started_at - services.job(culprit).finished_at).total_seconds()  # type: ignore[operator]
    print(f"worker restart: {restart_s:.1f} s from the crashed job's end to the fresh worker's registration")
    after = submit(services, two_invoke_payload(client_model), "alice")
    for job_id in (during_restart, after):
        assert services.wait_for(job_id, {S.COMPLETED, S.FAILED}, timeout=600).status is S.COMPLETED
    assert worker.process.poll() is None, "the supervisor keeps running"
    assert "starting it again" in worker.log()
