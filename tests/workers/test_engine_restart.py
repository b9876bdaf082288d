"""A worker's engine killed under it and started again in place (nnqueue.workers.engine_health, engine_restart), on
one worker process of the module's own (each test kills its engine): the worker stays registered, so jobs for the
model are accepted meanwhile, and its supervisor starts nothing.

* A trace that kills the engine fails alone; the jobs it shared the engine with complete. The crash counts against
  the owner whose trace caused it (the crash cool-down).
* The hard step deadline: intervention code blocked in C past the stall timeout is stopped by killing its engine
  (nnqueue.workers.stall_deadline); its job fails with ``InterventionStalled``, the job that shared its engine runs
  again on the fresh engine and completes. The stall watchdog's exception alone cannot stop either: a sleep never
  returns to bytecode, and a regular expression holds the GIL (the engine's own threads cannot run)."""

from __future__ import annotations

import re
import time
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
from tests.utils.payloads import PROMPTS, PayloadBackend, PrebuiltBackend, slow_payload, two_invoke_payload
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # a real worker process whose engine dies three times

S = JobStatus


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """The module's worker (stall timeout: 3 s); each test leaves it serving on a fresh engine."""
    return start_worker(max_concurrent_jobs=4)


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
    return services.submit(payload, owner=owner, timeout_s=900, api_key_id=api_key_id).id


def key_id(services: Services, owner: str) -> int:
    with transaction(services.sessions) as session:
        key, _ = auth.create_key(session, owner, ["trace"])
        return key.id


def test_the_trace_that_kills_the_engine_fails_alone_and_the_worker_serves_again(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    registered = worker.wait_registered()
    logged = len(worker.log())
    others = [submit(services, slow_payload(client_model, steps=20), owner) for owner in ("alice", "bob")]
    for job_id in others:
        services.wait_for(job_id, {S.RUNNING})
    trudy = key_id(services, "trudy")
    culprit = submit(services, engine_killing_payload(client_model), "trudy", trudy)

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
            owner="trudy",
            api_key_id=trudy,
            model_key=MODEL_KEY,
            payload=two_invoke_payload(client_model),
        )

    # The worker starts a fresh engine: it stays registered, so a job for the model is accepted meanwhile.
    during_restart = submit(services, two_invoke_payload(client_model), "alice")
    worker.wait_log("a fresh engine serves", timeout=300, after=logged)
    restart_s = re.findall(r"a fresh engine serves, ([0-9.]+) s after the engine died", worker.log()[logged:])
    print(f"engine restart: {restart_s} s from the engine's death to the fresh engine serving")
    after = submit(services, two_invoke_payload(client_model), "alice")
    for job_id in (during_restart, after):
        done = services.wait_for(job_id, {S.COMPLETED, S.FAILED}, timeout=600)
        assert done.status is S.COMPLETED and done.worker_id == registered.id, (done.error_type, done.error_message)
    assert worker.wait_registered().id == registered.id, "the same worker, never deregistered"
    assert len(restart_s) == 1 and "starting it again" not in worker.log()


def sleeping_payload(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        time.sleep(1000)  # in C: the watchdog's exception never lands
    return backend.payload


def regex_payload(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking, in C, holding the GIL
    return backend.payload


@pytest.mark.timeout(1800)  # two engine restarts
def test_code_blocked_in_c_fails_its_job_and_the_other_jobs_complete(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    registered = worker.wait_registered()
    logged = len(worker.log())
    for stall in (sleeping_payload, regex_payload):  # the second on the fresh engine the worker started
        # A job of the staller's owner shares the engine's steps with it (its trust domain); another owner's
        # waits for the engine to switch domains, which the stalled step holds up.
        beside = submit(services, slow_payload(client_model, steps=100), "mallory")
        services.wait_for(beside, {S.RUNNING}, timeout=600)
        staller = submit(services, stall(client_model), "mallory")
        waiting = submit(services, slow_payload(client_model, steps=2), "alice")

        failed = services.wait_for(staller, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
        assert failed.status is S.FAILED and failed.error_type == "InterventionStalled", (
            failed.error_type,
            failed.error_message,
        )
        assert "more than 3 s without returning control to the model" in failed.error_message
        assert "could not be interrupted" in failed.error_message
        assert failed.started_at is not None and failed.finished_at is not None
        stopped_s = (failed.finished_at - failed.started_at).total_seconds()
        print(f"{stall.__name__}: its job failed {stopped_s:.1f} s after it started (stall timeout 3 s)")

        for job_id in (beside, waiting):
            done = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=900)
            assert done.status is S.COMPLETED, (done.error_type, done.error_message)
        assert services.job(beside).attempts == 2  # requeued from the killed engine, run again on a fresh one
    log = worker.log()[logged:]
    assert log.count("killing engine process") == 2 and log.count("a fresh engine serves") == 2, log[-5000:]
    assert worker.wait_registered().id == registered.id and "starting it again" not in log  # the same worker
