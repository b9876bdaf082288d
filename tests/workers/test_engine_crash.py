"""A trace that kills the engine fails alone; the jobs it shared the engine with complete, and the worker
serves again on a fresh engine it starts itself (nnqueue.workers.engine_health, engine_restart): it stays
registered, so jobs for the model are accepted meanwhile, and its supervisor starts nothing. The crash counts
against the owner whose trace caused it (the crash cool-down)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from nnqueue.api import auth
from nnqueue.db.models import JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.scheduler.crash_cooldown import CrashCooldown
from nnqueue.scheduler.submission import submit_job
from tests.utils.payloads import PayloadBackend, slow_payload, two_invoke_payload
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # a real worker process whose engine dies twice

S = JobStatus


def engine_killing_payload(client: VLLM) -> bytes:
    """Replaces the storage of layer 0's KV cache (which no guard keeps: every step writes it): vLLM's own forward
    then fails in the engine core, also when the step runs again without the trace (a malformed intervention such
    as a wrong-shape ``.skip()`` no longer kills the engine: tests/engines/test_step_recovery.py)."""
    import torch

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


def test_the_trace_that_kills_the_engine_fails_alone_and_the_worker_serves_again(
    services: Services, start_worker: Callable[..., WorkerProcess], client_model: VLLM
) -> None:
    worker = start_worker(max_concurrent_jobs=4)
    registered = worker.wait_registered()
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

    # The worker starts a fresh engine: it stays registered, so a job for the model is accepted meanwhile.
    during_restart = submit(services, two_invoke_payload(client_model), "alice")
    worker.wait_log("a fresh engine serves", timeout=300)
    restart_s = re.findall(r"a fresh engine serves, ([0-9.]+) s after the engine died", worker.log())
    print(f"engine restart: {restart_s} s from the engine's death to the fresh engine serving")
    after = submit(services, two_invoke_payload(client_model), "alice")
    for job_id in (during_restart, after):
        done = services.wait_for(job_id, {S.COMPLETED, S.FAILED}, timeout=600)
        assert done.status is S.COMPLETED and done.worker_id == registered.id, (done.error_type, done.error_message)
    assert worker.wait_registered().id == registered.id, "the same worker, never deregistered"
    assert len(restart_s) == 1 and "starting it again" not in worker.log()
