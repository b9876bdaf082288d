"""A trace that kills the engine fails alone; the jobs it shared the engine with complete, and the
worker (restarted by its supervisor) serves again (nnqueue.workers.engine_health, supervisor)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import torch
from nnsight.modeling.vllm import VLLM

from nnqueue.db.models import JobStatus
from tests.utils.payloads import PayloadBackend, slow_payload, two_invoke_payload
from tests.utils.services import Services, WorkerProcess

pytestmark = pytest.mark.slow  # a real worker process whose engine dies twice

S = JobStatus


def engine_killing_payload(client: VLLM) -> bytes:
    """Skips layer 0 with a value of the wrong shape: vLLM's own forward then fails in the engine core."""
    backend = PayloadBackend()
    with client.trace("The Eiffel Tower is in", temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].skip((torch.zeros(6, 6), torch.zeros(6, 6)))
    return backend.payload


def submit(services: Services, payload: bytes, owner: str) -> uuid.UUID:
    return services.submit(payload, owner=owner, timeout_s=300).id


def test_the_trace_that_kills_the_engine_fails_alone_and_the_worker_serves_again(
    services: Services, start_worker: Callable[..., WorkerProcess], client_model: VLLM
) -> None:
    worker = start_worker(max_concurrent_jobs=4)
    others = [submit(services, slow_payload(client_model, steps=20), owner) for owner in ("alice", "bob")]
    for job_id in others:
        services.wait_for(job_id, {S.RUNNING})
    culprit = submit(services, engine_killing_payload(client_model), "mallory")

    failed = services.wait_for(culprit, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
    assert failed.status is S.FAILED and failed.error_type == "EngineCrash", (failed.error_type, failed.error_message)
    assert "crashed the engine" in failed.error_message and "must match" in failed.error_message
    for job_id in others:
        done = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
        assert done.status is S.COMPLETED, (done.error_type, done.error_message)

    worker.wait_registered(timeout=300)  # the supervisor's fresh worker (jobs need a live one to be accepted)
    after = submit(services, two_invoke_payload(client_model), "alice")
    assert services.wait_for(after, {S.COMPLETED, S.FAILED}, timeout=600).status is S.COMPLETED
    assert worker.process.poll() is None, "the supervisor keeps running"
    assert "starting it again" in worker.log()
