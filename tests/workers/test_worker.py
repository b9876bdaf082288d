"""A real worker process runs queued trace jobs on its one engine: values, batching, failures, cancels.

The jobs go through the real path: payload to S3, row to Postgres, message through Redis, and the
engine's result in S3 (through presigned URLs). Expected values come from transformers on the same
weights and from the same trace run in-process by nnsight's own flow on an engine in this test process.
Payloads are prebuilt as the nnqueue client builds them, or raw (``RequestModel.serialize``, as nnsight's
own clients send them), which the worker's sandboxed builder process rebuilds; this module's worker has
one builder, so consecutive raw payloads share its process.
"""

from __future__ import annotations

import linecache
import os
import platform
import runpy
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import select

from nnqueue import trace_payload
from nnqueue.db.lifecycle import InvalidTransition
from nnqueue.db.models import JobEvent, JobStatus, Worker
from nnqueue.scheduler import registry
from nnqueue.scheduler.cancellation import cancel_job
from nnqueue.scheduler.enqueue import send_job_tokens
from nnqueue.storage.keys import SAFETENSORS_FILE, sibling_key
from nnqueue.storage.results import load_result
from tests.utils.payloads import (
    PROMPTS,
    PayloadBackend,
    PrebuiltBackend,
    slow_payload,
    two_invoke_payload,
    two_invoke_trace,
)
from tests.utils.reference import reference_saves
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # end to end: a real worker process

S = JobStatus


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """No --max-concurrent-jobs: the worker runs as many jobs at once as its engine schedules (--max-num-seqs).
    Results of up to 1 MiB."""
    env = {"NNQUEUE_TRACE_BUILDERS": "1", "NNQUEUE_MAX_RESULT_BYTES": str(1 << 20)}
    return start_worker(max_concurrent_jobs=None, engine_args=["--max-num-seqs=5"], env=env)


def test_default_concurrency_follows_the_engines_max_num_seqs(worker: WorkerProcess) -> None:
    """Eight at once (the old default) left the engine's batches short: one-prompt jobs ran at 0.45x raw vLLM."""
    assert worker.wait_registered().capacity == 5
    worker.wait_log("running up to 5 jobs at once")


def test_the_engine_core_is_forked_by_the_builders_zygote(worker: WorkerProcess) -> None:
    """Not spawned: vLLM's import is paid once, by the zygote (nnqueue.enginecore.core_forks)."""
    [core] = [process for process in worker.children() if process.name().startswith("VLLM::EngineCor")]
    server = core.parent()
    zygote = server.parent()
    assert "nnqueue.engines.trace_builder" in zygote.cmdline()
    assert zygote.parent().parent().pid == worker.process.pid  # the zygote of the supervised worker
    worker.wait_log(f"the engine core (pid {core.pid}) is forked by the trace builders' zygote")


def submit(services: Services, payload: bytes, owner: str = "alice", timeout_s: float = 120) -> uuid.UUID:
    return services.submit(payload, owner=owner, timeout_s=timeout_s).id


def result_of(services: Services, job_id: uuid.UUID) -> dict[str, Any]:
    job = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED})
    assert job.status is S.COMPLETED, (job.error_type, job.error_message, job.error_traceback)
    return load_result(services.store.get_bytes(job.result_key))


def probe_payload(client: VLLM, prompt: str, **sampling: Any) -> bytes:
    """Saves the logits and, from inside the engine's forward, how many tokens that forward carried
    across all requests in the step (engine-side evidence of batching)."""
    import nnsight

    backend = PrebuiltBackend()
    with client.trace(prompt, temperature=0.0, backend=backend, **sampling):
        client.model.layers[0].output
        step_tokens = nnsight.save(client.interleaver.batcher.total)
        logits = client.logits.save()
    return backend.payload


@pytest.mark.parametrize("raw", [False, True], ids=["prebuilt", "raw"])
def test_two_invoke_trace_matches_transformers_and_an_in_process_run(
    services: Services,
    worker: WorkerProcess,
    client_model: VLLM,
    tiny_model_path: Path,
    inprocess_engine: Any,
    raw: bool,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job_id = services.submit(two_invoke_payload(client_model, raw=raw), wants_safetensors=True).id
    saves = result_of(services, job_id)

    in_process = reference_saves(client_model, inprocess_engine, two_invoke_trace)
    assert set(saves) == set(in_process) == {"h0", "logits0", "h1", "logits1"}
    for name, value in in_process.items():
        assert torch.equal(saves[name], value), name

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for index, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = hf(tokenizer(prompt, return_tensors="pt").input_ids, output_hidden_states=True)
        torch.testing.assert_close(saves[f"h{index}"], out.hidden_states[1][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(saves[f"logits{index}"][0], out.logits[0, -1], atol=1e-4, rtol=1e-4)

    job = services.job(job_id)
    assert job.result_format == "torch+safetensors" and job.progress_done == job.progress_total == 2
    assert job.result_key == f"results/{job_id}/1/saves.pt"
    assert services.store.size(sibling_key(job.result_key, SAFETENSORS_FILE)) > 0


SCRIPT = """
import nnsight
from nnqueue_test_model import model, backend, prompts

with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
{body}
"""
# Two users' (or two versions of one user's) scripts with the same file name, and their `with` blocks on the same lines.
SCALED = "    with tracer.invoke(prompts[0]):\n        scaled = (model.logits * {scale}).save()\n"
TWO_INVOKES = (
    "    with tracer.invoke(prompts[0]):\n        first = model.logits.save()\n"
    "    with tracer.invoke(prompts[1]):\n        second = model.logits.save()\n"
)


def raw_payload_of(script: Path, body: str, client: VLLM) -> bytes:
    """Write ``script`` and run it as its user would, in a fresh client (nnsight's caches of the test
    process cleared, as a new interpreter has them), capturing its trace as nnsight's remote clients send it."""
    import sys
    import types

    from nnsight.tracing.globals import BLOCKS, SOURCES

    script.write_text(SCRIPT.format(body=body))
    backend = PayloadBackend()
    module = types.ModuleType("nnqueue_test_model")
    module.model, module.backend, module.prompts = client, backend, PROMPTS
    sys.modules["nnqueue_test_model"] = module
    SOURCES.clear()
    BLOCKS.clear()
    linecache.checkcache(str(script))
    try:
        runpy.run_path(str(script))
    finally:
        del sys.modules["nnqueue_test_model"]
    return backend.payload


def test_raw_traces_from_the_same_file_each_run_their_own_code(
    services: Services, worker: WorkerProcess, client_model: VLLM, tmp_path: Path
) -> None:
    import torch

    script = tmp_path / "experiment.py"
    versions = [raw_payload_of(script, SCALED.format(scale=scale), client_model) for scale in ("1.0", "2.0")]
    other = raw_payload_of(script, TWO_INVOKES, client_model)

    # One builder process builds all three, one after the other.
    one, two = (result_of(services, submit(services, payload)) for payload in versions)
    torch.testing.assert_close(two["scaled"], 2 * one["scaled"])
    both = result_of(services, submit(services, other))
    assert set(both) == {"first", "second"}
    torch.testing.assert_close(both["first"], one["scaled"])


def test_trace_level_code_of_a_raw_payload_runs_in_the_protected_environment(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    import nnsight

    # What it could reach without it (no secret, the engine user) and a builder that dies: test_isolation.py.
    backend = PayloadBackend()
    with client_model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        seen = nnsight.save(sorted(os.environ))  # trace-level code, rebuilt in the builder process
        with tracer.invoke(PROMPTS[0]):
            logits = client_model.logits.save()
    refused = services.wait_for(submit(services, backend.payload), {S.FAILED, S.COMPLETED})
    assert refused.error_type == "ProtectedEnvironmentError" and "module 'os' is not allowed" in refused.error_message
    assert "logits0" in result_of(services, submit(services, two_invoke_payload(client_model, raw=True)))


def test_progress_is_written_as_invokes_finish(services: Services, worker: WorkerProcess, client_model: VLLM) -> None:
    backend = PrebuiltBackend()
    with client_model.trace(temperature=0.0, backend=backend) as tracer:
        with tracer.invoke(PROMPTS[0], max_tokens=1):
            quick = client_model.logits.save()
        with tracer.invoke(PROMPTS[1], max_tokens=100, ignore_eos=True):
            for _ in tracer.iter[:]:
                time.sleep(0.1)
                client_model.logits
            slow = client_model.logits.save()
    job_id = submit(services, backend.payload)
    deadline = time.monotonic() + 60
    while (job := services.job(job_id)).status is not S.COMPLETED:
        assert job.status in (S.QUEUED, S.RUNNING) and time.monotonic() < deadline, job.status
        if (job.progress_done, job.progress_total) == (1, 2):
            break
        time.sleep(0.1)
    assert (job.status, job.progress_done, job.progress_total) == (S.RUNNING, 1, 2)
    cancel_job(services.sessions, job_id, by="alice")


def test_jobs_from_two_owners_are_batched_in_the_same_engine_steps(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    import torch

    # Each job decodes for a while, so the jobs submitted together overlap on the engine.
    payloads = {prompt: probe_payload(client_model, prompt, max_tokens=32, ignore_eos=True) for prompt in PROMPTS}
    jobs = [(prompt, submit(services, payloads[prompt], owner)) for owner in ("alice", "bob") for prompt in PROMPTS * 2]
    assert len(jobs) == 8

    solo = {prompt: result_of(services, submit(services, payloads[prompt])) for prompt in PROMPTS}
    shared_steps = 0
    for prompt, job_id in jobs:
        saves = result_of(services, job_id)
        own_tokens = len(client_model.tokenizer(prompt).input_ids)
        # More tokens in this job's prefill forward than its own prompt: another job shared the step.
        shared_steps += saves["step_tokens"] > own_tokens
        # Sharing a step with other users' jobs does not change this job's values.
        torch.testing.assert_close(saves["logits"], solo[prompt]["logits"], atol=1e-4, rtol=1e-4)
    assert shared_steps >= 2


def test_failing_jobs_fail_alone_while_a_good_job_completes(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        hidden = client_model.model.layers[0].output[0]
        raise ValueError(f"user code broke on a tensor of shape {tuple(hidden.shape)}")
    raising = backend.payload

    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client_model.model.layers[0].output
        spins = 0
        while True:  # the user's bug: never hands control back to the model
            spins += 1
    looping = backend.payload

    looping_id = submit(services, looping)
    raising_id = submit(services, raising)
    slow_id = submit(services, slow_payload(client_model, steps=200), timeout_s=3)
    good_id = submit(services, probe_payload(client_model, PROMPTS[0], max_tokens=4))

    assert "logits" in result_of(services, good_id)

    failed = services.wait_for(raising_id, {S.FAILED, S.COMPLETED})
    assert failed.status is S.FAILED and failed.error_type == "ValueError"
    assert "user code broke on a tensor of shape" in failed.error_message
    assert "raise ValueError" in failed.error_traceback

    # The engine stops the loop after NNQUEUE_ENGINE_STALL_TIMEOUT_S (3 s here).
    stalled = services.wait_for(looping_id, {S.FAILED, S.COMPLETED})
    assert stalled.status is S.FAILED and stalled.error_type == "InterventionStalled"
    assert "more than 3 s without returning control to the model" in stalled.error_message

    timed_out = services.wait_for(slow_id, {S.FAILED, S.COMPLETED})
    assert timed_out.status is S.FAILED and timed_out.error_type == "JobTimeout"
    assert "timeout of 3 s" in timed_out.error_message
    assert (timed_out.finished_at - timed_out.started_at).total_seconds() < 15  # not the ~20 s it would take

    # The engine survived all three: a job after them runs.
    assert "logits" in result_of(services, submit(services, probe_payload(client_model, PROMPTS[1], max_tokens=1)))


def test_a_result_over_the_limit_fails_its_job_naming_the_limit(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    import torch

    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client_model.model.layers[0].output
        big = torch.zeros(512 * 1024).save()  # 2 MiB
    failed = services.wait_for(submit(services, backend.payload), {S.FAILED, S.COMPLETED})
    assert failed.status is S.FAILED and failed.error_type == "ResultTooLarge", (
        failed.error_type,
        failed.error_message,
    )
    assert "over this deployment's limit of 1048576 bytes per job (NNQUEUE_MAX_RESULT_BYTES)" in failed.error_message
    assert failed.result_key is None  # nothing stored


def test_undeserializable_payload_fails_clearly_naming_both_sides_versions(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    import nnsight

    server = f"server nnsight {nnsight.__version__} / python {platform.python_version()}"
    old_client = {"nnsight": "0.7.2", "python": "3.10.4"}
    # What each format looks like from a client whose nnsight this server cannot read: bytes that are
    # no trace at all, a raw payload that does not unpickle, and a prebuilt one whose mediators do not load.
    garbage = b"this is not a serialized nnsight trace"
    unknown_class = b"\x8c\x0bnot_nnsight\x8c\x05Trace\x93."  # a pickled class this server does not have
    raw = trace_payload.PICKLE_PROTOCOL_4 + len(unknown_class).to_bytes(8, "little") + unknown_class
    invoke = trace_payload.decode(probe_payload(client_model, PROMPTS[0], max_tokens=1)).invokes[0]
    stale_invoke = trace_payload.Invoke(invoke.prompt, invoke.sampling, b"\x80\x04" + unknown_class)
    stale = trace_payload.encode(trace_payload.PrebuiltTrace([stale_invoke], *old_client.values()))
    for payload in (garbage, raw, stale):
        job = services.submit(payload, meta={"client": old_client})
        failed = services.wait_for(job.id, {S.FAILED, S.COMPLETED})
        assert failed.status is S.FAILED and failed.error_message.startswith("could not rebuild the trace"), (
            failed.error_message
        )
        assert f"(client nnsight 0.7.2 / python 3.10.4, {server})" in failed.error_message


def test_a_job_cancelled_while_queued_never_runs(services: Services, worker: WorkerProcess, client_model: VLLM) -> None:
    # Submitted for a model whose only worker row has no process behind it (nothing consumes its queue),
    # cancelled; then a token, sent anew to the real worker's queue, finds no queued work there and is dropped.
    registry.register(services.sessions, registry.new_worker_id(), "nobody-serves-this", "no-consumer", 1)
    job = services.submit(probe_payload(client_model, PROMPTS[0], max_tokens=1), model_key="nobody-serves-this")
    cancel_job(services.sessions, job.id, by="alice")
    send_job_tokens(services.celery, MODEL_KEY)
    worker.wait_log(f"a token for {MODEL_KEY} found no queued job; dropped")

    after = services.job(job.id)
    assert after.status is S.CANCELLED and after.started_at is None and after.attempts == 0
    with services.sessions() as session:
        statuses = session.scalars(select(JobEvent.to_status).where(JobEvent.job_id == job.id)).all()
    assert statuses == [S.QUEUED, S.CANCELLED]


def test_a_job_cancelled_while_running_is_aborted(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    job_id = submit(services, slow_payload(client_model, steps=200))  # about 20 s unless aborted
    services.wait_for(job_id, {S.RUNNING})

    cancel_job(services.sessions, job_id, by="alice")
    worker.wait_log(f"job {job_id} cancelled", timeout=15)
    with pytest.raises(InvalidTransition):
        cancel_job(services.sessions, job_id, by="alice")
    assert services.job(job_id).result_key is None
    # The engine is free again for the next job.
    assert "logits" in result_of(services, submit(services, probe_payload(client_model, PROMPTS[1], max_tokens=1)))


def test_a_remote_control_shutdown_neither_stops_nor_restarts_the_worker(
    services: Services, worker: WorkerProcess, client_model: VLLM
) -> None:
    """Celery's remote-control ``shutdown``, published on the broker as a trace that reached it would: the
    worker does not listen (remote control is off), so it neither stops (a warm shutdown, then its supervisor's
    restart) nor is its registration ended, and the next job runs on it."""
    before = worker.wait_registered()
    worker.wait_log(" ready.", timeout=120)  # Celery's consumer is up: a broadcast now reaches a listening worker
    services.celery.control.broadcast("shutdown")
    assert "logits" in result_of(services, submit(services, probe_payload(client_model, PROMPTS[0], max_tokens=1)))
    time.sleep(3)  # a worker that obeyed logs it at once, and ends its registration as it stops
    log = worker.log()
    assert "shutdown from remote" not in log and "starting it again" not in log, log[-3000:]
    with services.sessions() as session:
        row = session.get(Worker, before.id)
        assert row is not None and row.stopped_at is None
    assert worker.process.poll() is None
