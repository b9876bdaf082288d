"""The client and its nnsight backend through the real API, queue and worker.

Ordinary nnsight code with ``backend=client.backend()`` gets the same saved values, in its own
variables, as the same trace run in-process on an engine in this process; a worker-side error comes back
with its type and traceback; the non-blocking form returns a Job; downloads match the stored bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from typing import Any

import pytest
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.client import (
    AuthenticationError,
    Client,
    ConflictError,
    IntegrityError,
    Job,
    JobCancelled,
    JobFailed,
    NotFoundError,
    UnknownModelError,
    WaitTimeout,
)
from nnqueue.embedded import ApiServer
from tests.utils.payloads import fake_trace
from tests.utils.reference import InProcessBackend
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

# End to end: a real worker process behind a real API server: the shared one.
pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]

PROMPT = "The Eiffel Tower is in"


def test_the_issue_snippet_gives_the_in_process_values_in_the_callers_variables(
    client: Client, worker: WorkerProcess, client_model: Any, inprocess_engine: Any
) -> None:
    import torch

    model = client_model
    with model.trace(PROMPT, backend=client.backend(model_key=MODEL_KEY), max_tokens=3, temperature=0.0):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()
    queued_hidden, queued_logits = hidden, logits

    with model.trace(PROMPT, backend=InProcessBackend(inprocess_engine), max_tokens=3, temperature=0.0):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()

    assert isinstance(queued_hidden, tuple) and len(queued_hidden) == 2  # vLLM's Llama layer: (mlp_out, residual)
    for got, want in zip(queued_hidden, hidden, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(queued_logits, logits)


def test_the_backend_is_reusable_and_records_each_job(client: Client, worker: WorkerProcess, client_model: Any) -> None:
    model = client_model
    backend = client.backend(model_key=MODEL_KEY, progress=False, metadata={"experiment": "reuse"}, priority=3)
    for prompt in (PROMPT, "A job queue runs many traces"):
        with model.trace(prompt, backend=backend, max_tokens=1, temperature=0.0):
            logits = model.logits.save()
        assert logits.shape[0] == 1 or logits.ndim == 1
    assert len(backend.jobs) == 2 and backend.job is backend.jobs[-1]
    info = backend.job.info
    assert info["status"] == "completed" and info["metadata"] == {"experiment": "reuse"} and info["priority"] == 3
    assert info["progress"] == {"done": 1, "total": 1}


def test_a_worker_side_user_error_reraises_with_its_type_and_traceback(
    client: Client, worker: WorkerProcess, client_model: Any
) -> None:
    model = client_model
    with pytest.raises(JobFailed) as caught:
        with model.trace(PROMPT, backend=client.backend(model_key=MODEL_KEY), max_tokens=1, temperature=0.0):
            hidden = model.model.layers[0].output[0]
            raise ValueError(f"user code broke on a tensor of shape {tuple(hidden.shape)}")

    error = caught.value
    assert isinstance(error, RuntimeError)  # what nnsight's raise_deferred raises
    assert error.type_name == "ValueError"
    assert str(error).startswith("ValueError: user code broke on a tensor of shape (")
    assert "\n\nIntervention traceback:\n" in str(error)
    assert "raise ValueError" in error.traceback and "raise ValueError" in str(error)
    assert error.job is not None and error.job.info["status"] == "failed"
    assert error.job.info["error"]["type"] == "ValueError"


def test_an_index_error_in_a_trace_surfaces_as_an_index_error(
    client: Client, worker: WorkerProcess, client_model: Any, api_server: ApiServer, secret: str
) -> None:
    model = client_model
    # Through the backend: as a local vLLM run raises it (nnsight's raise_deferred: a RuntimeError "IndexError:
    # ..."), and an IndexError too.
    with pytest.raises(IndexError) as caught:
        with model.trace(PROMPT, backend=client.backend(model_key=MODEL_KEY), max_tokens=1, temperature=0.0):
            hidden = model.model.layers[0].output[0]
            [hidden][3]
    error = caught.value
    assert isinstance(error, JobFailed) and isinstance(error, RuntimeError)
    assert str(error).startswith("IndexError: list index out of range\n\nIntervention traceback:\n")
    assert error.job is not None and f"job {error.job.id} failed on the worker" in error.__notes__

    # Through the Client API: the worker's IndexError, and nothing a local IndexError is not.
    backend = client.backend(model_key=MODEL_KEY, blocking=False)
    with model.trace(PROMPT, backend=backend, max_tokens=1, temperature=0.0):
        [model.model.layers[0].output[0]][3]
    assert backend.job is not None
    with pytest.raises(IndexError) as caught:
        client.job(backend.job.id).result(timeout=120, progress=False)
    error = caught.value
    assert isinstance(error, JobFailed) and not isinstance(error, RuntimeError)
    assert str(error) == "list index out of range" and "[model.model.layers[0].output[0]][3]" in error.traceback

    # The CLI shows the worker's type and traceback.
    shown = run_cli(["status", backend.job.id], api_server.url, secret)
    assert shown.exit_code == 0 and "IndexError" in shown.output and "worker traceback" in shown.output


def test_the_non_blocking_backend_returns_the_job(
    client: Client, worker: WorkerProcess, client_model: Any, inprocess_engine: Any
) -> None:
    import torch

    model = client_model
    backend = client.backend(model_key=MODEL_KEY, blocking=False)
    with model.trace(PROMPT, backend=backend, max_tokens=1, temperature=0.0):
        logits = model.logits.save()
    assert "logits" not in locals()  # nothing was waited for, so nothing landed here
    job = backend.job
    assert isinstance(job, Job) and job.model_key == MODEL_KEY
    assert job.info["status"] in ("queued", "running", "completed")

    saves = job.result(timeout=120)

    with model.trace(PROMPT, backend=InProcessBackend(inprocess_engine), max_tokens=1, temperature=0.0):
        logits = model.logits.save()
    assert torch.equal(saves["logits"], logits)
    assert job.status() == "completed" and job.done


def test_download_writes_the_stored_bytes_by_presigned_url_and_inline(
    client: Client, services: Services, worker: WorkerProcess, client_model: Any, tmp_path: Any
) -> None:
    model = client_model
    backend = client.backend(model_key=MODEL_KEY, blocking=False)
    with model.trace(PROMPT, backend=backend, max_tokens=2, temperature=0.0):
        hidden = model.model.layers[0].output[0].save()
        logits = model.logits.save()
    job = backend.job
    assert job is not None

    path = job.download(tmp_path / "result.pt", progress=True)  # waits for the job first
    stored = services.store.get_bytes(services.job(uuid.UUID(job.id)).result_key)
    assert path == tmp_path / "result.pt" and path.read_bytes() == stored
    assert len(stored) == job.info["result"]["size"]
    assert not (tmp_path / "result.pt.part").exists()

    inline = job.download(tmp_path, inline=True)  # a directory: <id>.pt in it
    assert inline == tmp_path / f"{job.id}.pt" and inline.read_bytes() == stored
    assert set(job.result(inline=True)) == {"hidden", "logits"}


def test_a_result_changed_in_the_store_fails_every_download_loudly(
    client: Client,
    api_server: ApiServer,
    secret: str,
    services: Services,
    worker: WorkerProcess,
    client_model: Any,
    tmp_path: Any,
) -> None:
    model = client_model
    backend = client.backend(model_key=MODEL_KEY, blocking=False, safetensors=True)
    with model.trace(PROMPT, backend=backend, max_tokens=1, temperature=0.0):
        logits = model.logits.save()  # saved under its name; the non-blocking backend fills in nothing
    job = backend.job
    assert job is not None
    job.wait(progress=False)
    row = services.job(uuid.UUID(job.id))
    keys = {"torch": row.result_key, "safetensors": row.result_key.rsplit("/", 1)[0] + "/saves.safetensors"}
    stored = {name: services.store.get_bytes(key) for name, key in keys.items()}
    recorded = job.info["result"]
    assert recorded["sha256"] == hashlib.sha256(stored["torch"]).hexdigest() == row.result_sha256
    assert recorded["safetensors"] == {
        "size": len(stored["safetensors"]),
        "sha256": hashlib.sha256(stored["safetensors"]).hexdigest(),
    }
    assert set(job.result(progress=False)) == {"logits"}  # the genuine bytes load

    for name, key in keys.items():  # same-size forgeries, written straight into the store (S3)
        forged = bytearray(stored[name])
        forged[-9] ^= 0xFF
        services.store.put_bytes(key, bytes(forged))

    for inline in (False, True):
        with pytest.raises(IntegrityError, match="sha256"):
            job.result(progress=False, inline=inline)
        for fmt in ("torch", "safetensors"):
            with pytest.raises(IntegrityError, match=f"the {fmt} result of job {job.id} does not match"):
                job.download(tmp_path / "out", progress=False, inline=inline, format=fmt)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.part"))
    for extra in ([], ["--safetensors"], ["--inline"]):
        refused = run_cli(["download", job.id, str(tmp_path / "cli.pt"), *extra], api_server.url, secret)
        assert refused.exit_code == 1 and "IntegrityError" in refused.output, refused.output
    assert not (tmp_path / "cli.pt").exists()


def test_listing_fetching_cancelling_and_http_errors(
    client: Client, api_server: ApiServer, worker: WorkerProcess, client_model: Any
) -> None:
    model = client_model
    backend = client.backend(model_key=MODEL_KEY, blocking=False)
    with model.trace(PROMPT, backend=backend, max_tokens=1, temperature=0.0):
        logits = model.logits.save()
    job = backend.job
    assert job is not None
    job.wait(timeout=120, progress=False)

    listed = [listed.id for listed in client.jobs(page_size=1)]  # one per page: follows the cursor
    assert job.id in listed and len(listed) == len(set(listed)) >= 2
    assert next(j.id for j in client.jobs(status="completed", model_key=MODEL_KEY)) == job.id
    assert all(j.info["status"] == "failed" for j in client.jobs(status="failed"))
    assert client.job(job.id).info["status"] == "completed"
    (listed_model,) = [model for model in client.models() if model["model_key"] == MODEL_KEY]
    assert {key: listed_model[key] for key in ("model_key", "workers", "capacity", "engine", "taps")} == {
        "model_key": MODEL_KEY,
        "workers": 1,
        "capacity": 4,
        "engine": "vllm",
        "taps": None,
    }
    assert list(listed_model["weights_versions"].values()) == [1]  # the one worker's base version

    with pytest.raises(ConflictError) as conflict:
        job.cancel()
    assert conflict.value.status_code == 409 and "only queued or running jobs can be cancelled" in str(conflict.value)

    with pytest.raises(UnknownModelError) as unknown:
        client.submit("no-such-model", fake_trace())
    assert unknown.value.status_code == 400 and repr(MODEL_KEY) in str(unknown.value.detail)

    with pytest.raises(NotFoundError):
        client.job("00000000-0000-0000-0000-000000000000")
    with Client(api_server.url, "nnq_not-a-real-key") as stranger:
        with pytest.raises(AuthenticationError) as unauthorized:
            stranger.job(job.id)
    assert unauthorized.value.status_code == 401


def slow_trace(model: Any, backend: Any, steps: int = 200) -> None:
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, ignore_eos=True, backend=backend) as tracer:
        for _ in tracer.iter[:]:
            time.sleep(0.1)
            model.logits
        last = model.logits.save()


def test_waiting_times_out_and_a_cancelled_job_raises(client: Client, worker: WorkerProcess, client_model: Any) -> None:
    backend = client.backend(model_key=MODEL_KEY, blocking=False)
    slow_trace(client_model, backend)  # about 20 s unless cancelled
    job = backend.job
    assert job is not None
    with pytest.raises(WaitTimeout):
        job.wait(timeout=0.5, progress=False)
    assert job.cancel().info["status"] == "cancelled"
    with pytest.raises(JobCancelled):
        job.wait(timeout=30)
    with pytest.raises(JobCancelled):
        job.result()


# -- the client commands ----------------------------------------------------------------------------

SCRIPT = """
import sys

from nnsight.modeling.vllm import VLLM

from nnqueue.client import Client

model = VLLM(sys.argv[1], dtype="float32", max_model_len=256, seed=0)
client = Client.from_env()
for prompt in ("The Eiffel Tower is in", "A job queue runs many traces"):
    with model.trace(prompt, backend=client.backend(model_key="tiny-llama"), max_tokens=1, temperature=0.0):
        logits = model.logits.save()
    print("logits shape", tuple(logits.shape))
"""
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def run_cli(args: list[str], url: str, secret: str) -> Any:
    result = CliRunner().invoke(
        app, args, env={"NNQUEUE_URL": url, "NNQUEUE_API_KEY": secret, "COLUMNS": "250"}, catch_exceptions=False
    )
    return result


def test_submit_queues_a_scripts_traces_and_the_other_commands_follow_them(
    api_server: ApiServer,
    secret: str,
    services: Services,
    worker: WorkerProcess,
    tiny_model_path: Any,
    client_model: Any,
    tmp_path: Any,
) -> None:
    import torch

    script = tmp_path / "trace_two_prompts.py"
    script.write_text(SCRIPT)

    queued = run_cli(["submit", str(script), "--", str(tiny_model_path)], api_server.url, secret)
    # Without --wait the traces only queue: the script's first read of a saved value fails, after one job.
    assert queued.exit_code == 1
    assert "NameError" in queued.output and "without --wait traces only queue jobs" in queued.output
    [job_id] = set(UUID.findall(queued.output))
    assert "1 job(s) submitted by trace_two_prompts.py" in queued.output
    assert os.environ.get("NNQUEUE_BLOCKING") is None  # the command's exports do not outlive it

    waited = run_cli(["submit", str(script), "--wait", "--", str(tiny_model_path)], api_server.url, secret)
    assert waited.exit_code == 0, waited.output
    assert waited.output.count("logits shape (") == 2 and "2 job(s) submitted" in waited.output
    assert waited.output.count("completed") >= 2

    downloaded = run_cli(["download", job_id, str(tmp_path / "out.pt")], api_server.url, secret)
    assert downloaded.exit_code == 0, downloaded.output
    assert (tmp_path / "out.pt").read_bytes() == services.store.get_bytes(services.job(uuid.UUID(job_id)).result_key)
    assert set(torch.load(tmp_path / "out.pt", weights_only=False)) == {"logits"}

    status = run_cli(["status", job_id], api_server.url, secret)
    assert status.exit_code == 0 and "completed" in status.output and "tiny-llama" in status.output

    listed = run_cli(["jobs", "--status", "completed", "--limit", "2"], api_server.url, secret)
    assert listed.exit_code == 0 and len(set(UUID.findall(listed.output))) == 2

    refused = run_cli(["cancel", job_id], api_server.url, secret)
    assert refused.exit_code == 1 and "ConflictError" in refused.output and "409" in refused.output

    models = run_cli(["models"], api_server.url, secret)
    assert models.exit_code == 0 and "tiny-llama" in models.output

    unauthorized = run_cli(["jobs"], api_server.url, "nnq_wrong")
    assert unauthorized.exit_code == 1 and "AuthenticationError" in unauthorized.output


def test_status_shows_a_failed_jobs_worker_traceback(
    api_server: ApiServer, secret: str, client: Client, worker: WorkerProcess, client_model: Any
) -> None:
    model = client_model
    backend = client.backend(model_key=MODEL_KEY, blocking=False)
    with model.trace(PROMPT, backend=backend, max_tokens=1, temperature=0.0):
        model.model.layers[0].output
        raise KeyError("no such feature")
    assert backend.job is not None

    shown = run_cli(["status", backend.job.id, "--wait"], api_server.url, secret)
    assert shown.exit_code == 1  # --wait on a job that did not complete
    assert "failed" in shown.output and "KeyError" in shown.output
    assert "worker traceback" in shown.output and "raise KeyError(" in shown.output
