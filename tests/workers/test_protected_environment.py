"""Intervention code on a real worker runs in the protected environment (nnqueue.enginecore.protected):
allowed modules work, a refused import fails the job with an error that names the module."""

from __future__ import annotations

import os
import pickle
import time
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import delete

from nnqueue.db.models import DomainMember, JobStatus
from nnqueue.db.session import transaction
from nnqueue.storage.results import load_result
from tests.utils.payloads import PayloadBackend, PrebuiltBackend
from tests.utils.services import Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

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


# --- issue 33, "Why" 1: one-line escapes through allowed modules, and a payload that ran code while it loaded ---


def _escape(client: VLLM, which: str) -> bytes:
    backend = PrebuiltBackend()
    with client.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        from nnsight.util import from_import_path

        if which == "audit":
            events = from_import_path("nnqueue.enginecore.protected")
            events._WATCHED_EVENTS = frozenset()
        elif which == "exec":
            ran = from_import_path("builtins.exec")("0")
        elif which == "from_file":
            read = from_import_path("torch.from_file")("/etc/hostname", False, 8)
        logits = client.logits.save()
    return backend.payload


def _envoy_lookup(client: VLLM, which: str) -> bytes:
    backend = PrebuiltBackend()
    with client.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        if which == "envoy_get":
            real = client.get("__class__.__init__.__globals__")["__builtins__"]
        else:
            real = client.model.norm["__class__"]
        logits = client.logits.save()
    return backend.payload


@pytest.mark.parametrize("which", ["audit", "exec", "from_file", "envoy_get", "envoy_getitem"])
def test_nnsights_import_and_attribute_helpers_lead_nowhere(
    services: Services, worker: WorkerProcess, client_model: VLLM, which: str
) -> None:
    envoy = which.startswith("envoy")
    payload = _envoy_lookup(client_model, which) if envoy else _escape(client_model, which)
    status, error, _ = run(services, payload)
    assert status is JobStatus.FAILED, error
    expected = "'__class__' is not available" if envoy else "nnsight.util.from_import_path"
    assert expected in error, error


def test_a_mediator_pickle_of_allowed_globals_that_changes_a_class_fails_at_claim(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    # BUILD on torch.Tensor, a class the pickle may name: nnsight's C unpickler would set the attribute on it, for
    # every later job, in the builder and again in the engine; the builder's strict check refuses it by opcode.
    status, error, _ = run(services, _prebuilt(b"ctorch\nTensor\n(N(S'__add__'\ncbuiltins\nprint\ndtb."))
    assert status is JobStatus.FAILED
    assert "'Tensor' while a payload loads (not built by it) is not allowed" in error, (
        error
    )  # its metaclass's name: _TensorMeta
    allowed = PrebuiltBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=allowed):
        import torch

        total = (torch.ones(2) + torch.ones(2)).sum().save()  # Tensor.__add__ is still torch's
    status, error, saves = run(services, allowed.payload)
    assert status is JobStatus.COMPLETED and float(saves["total"]) == 4.0, error


# --- issue 33, item 3: a step shared by an innocent and a hostile trace: the replay names the hostile one ---


def test_in_a_shared_step_only_the_trace_that_changes_the_state_again_alone_fails(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    innocent = PrebuiltBackend()  # 40 decoding steps of 0.1 s each, saving the logits of every one
    with client_model.trace("Hello", temperature=0.0, max_tokens=40, ignore_eos=True, backend=innocent) as tracer:
        steps = list().save()
        for _ in tracer.iter[:]:
            time.sleep(0.1)
            steps.append(client_model.logits)
    innocent_payload = innocent.payload
    _, _, reference = run(services, innocent_payload)
    hostile = PrebuiltBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=hostile):
        client_model.model.norm._module.variance_epsilon = 1e4
        logits = client_model.logits.save()

    with transaction(services.sessions) as session:  # one trust domain: else their traces never share a step
        session.add_all(DomainMember(owner=owner, domain="lab") for owner in ("alice", "mallory"))
    try:
        innocent = services.submit(innocent_payload, owner="alice")
        services.wait_for(innocent.id, {JobStatus.RUNNING})
        time.sleep(1.5)  # its requests are in the engine, decoding a step every 0.1 s
        culprit = services.submit(hostile.payload, owner="mallory")  # decodes along with alice's: a shared step
        failed = services.wait_for(culprit.id, {JobStatus.COMPLETED, JobStatus.FAILED}, timeout=300)
        done = services.wait_for(innocent.id, {JobStatus.COMPLETED, JobStatus.FAILED}, timeout=300)
    finally:
        with transaction(services.sessions) as session:
            session.execute(delete(DomainMember).where(DomainMember.owner.in_(["alice", "mallory"])))
    assert failed.status is JobStatus.FAILED and failed.error_type == "StateModified", failed.error_message
    assert failed.meta.get("shared_step_retries") == 1  # it ran again alone, and changed the state again
    assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
    assert done.meta.get("shared_step_retries") == 1  # alice's ran again alone too, and is not blamed
    saves = load_result(services.store.get_bytes(done.result_key))
    assert len(saves["steps"]) == len(reference["steps"]) == 40
    assert all(map(torch_equal, saves["steps"], reference["steps"]))  # alice's values are her own, untouched


def torch_equal(first: Any, second: Any) -> bool:
    import torch

    return bool(torch.equal(first, second))
