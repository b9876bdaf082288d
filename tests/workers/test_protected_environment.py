"""Intervention code on a real worker runs in the protected environment (nnqueue.enginecore.protected):
allowed modules work, a refused import fails the job with an error that names the module."""

from __future__ import annotations

import os
import pickle
import time

import pytest
from nnsight.modeling.vllm import VLLM

from nnqueue.db.models import JobStatus
from nnqueue.storage.results import load_result
from tests.utils.payloads import PayloadBackend, PrebuiltBackend
from tests.utils.services import Services, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]  # a real worker process (the shared one)


def run(services: Services, payload: bytes) -> tuple[JobStatus, str, dict]:
    job = services.submit(payload, owner="eve")
    done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED})
    saves = load_result(services.store.get_bytes(done.result_key)) if done.status is JobStatus.COMPLETED else {}
    return done.status, f"{done.error_type}: {done.error_message}", saves


def test_allowed_modules_run(services: Services, worker: WorkerProcess, client_model: VLLM) -> None:
    backend = PayloadBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        import math

        import torch

        logits = client_model.logits
        top = torch.topk(logits, 2).values.save()
        scale = math.sqrt(4.0)
        scaled = (logits * scale).save()

    status, error, saves = run(services, backend.payload)
    assert status is JobStatus.COMPLETED, error
    assert saves["top"].shape[-1] == 2 and saves["scaled"].shape == saves["scaled"].shape


def test_an_import_of_os_inside_the_trace_fails_the_job_naming_it(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    backend = PayloadBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        import os as stolen

        environment = dict(stolen.environ).save()
        client_model.logits

    status, error, _ = run(services, backend.payload)
    assert status is JobStatus.FAILED
    assert "module 'os' is not allowed in intervention code" in error


def test_a_module_sent_from_the_clients_globals_is_refused_when_unpickled(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    backend = PayloadBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        environment = dict(os.environ).save()  # `os` is this module's: it travels in the payload
        client_model.logits

    status, error, _ = run(services, backend.payload)
    assert status is JobStatus.FAILED
    assert "module 'os' is not allowed in intervention code" in error


def _prebuilt(mediator: bytes) -> bytes:
    """A prebuilt payload of one invoke whose mediator bytes are ``mediator``, as a hand-made client sends it."""
    from nnqueue import trace_payload

    invoke = trace_payload.Invoke({"prompt": "Hello"}, {"max_tokens": 1, "temperature": 0.0}, mediator)
    return trace_payload.encode(trace_payload.PrebuiltTrace([invoke], nnsight="0.8.1", python="3.11.7"))


@pytest.mark.parametrize(
    ("mediator", "cause"),
    [
        (
            pickle.dumps(1),
            "InvalidMediator: could not rebuild the trace: invoke 0's mediator cannot be loaded: the"
            " request's nnsight_mediator holds a int, not an nnsight Mediator",
        ),
        (pickle.dumps([1, 2])[:-3], "invoke 0's mediator cannot be loaded"),  # a pickle that fails to load
        (
            b"ctorch\nserialization.os.system\n(S'true'\ntR.",
            "torch.serialization.os.system (a module reached through attributes) is not allowed",
        ),
    ],
)
def test_a_malformed_mediator_fails_its_job_at_claim_and_the_engine_serves_on(
    services: Services, worker: WorkerProcess, client_model: VLLM, mediator: bytes, cause: str
) -> None:
    processes = {child.pid for child in worker.children()}  # the engine's among them
    status, error, _ = run(services, _prebuilt(mediator))
    assert status is JobStatus.FAILED
    assert cause in error
    # The engine never saw it: no process of the worker's ended, and the next job runs at once.
    assert processes <= {child.pid for child in worker.children()}
    backend = PrebuiltBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        top = client_model.logits.argmax(-1).save()
    started = time.monotonic()
    status, error, saves = run(services, backend.payload)
    assert status is JobStatus.COMPLETED, error
    assert time.monotonic() - started < 60 and saves["top"].shape == (1,)


def test_a_format_string_cannot_reach_the_engines_globals(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    backend = PrebuiltBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        import random

        environment = "{0.__init__.__globals__[_os].environ}".format(random.Random()).save()  # noqa: UP030, UP032
        client_model.logits

    status, error, _ = run(services, backend.payload)
    assert status is JobStatus.FAILED
    assert "the attribute 'format' (use an f-string) is not allowed" in error
