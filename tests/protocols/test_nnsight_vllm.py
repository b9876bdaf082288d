"""nnsight 0.8.1's own ``remote=True`` and ``serve=`` clients, unmodified, against nnqueue and a real vLLM worker.

The worker serves the tiny model under the key nnsight's client sends for ``VLLM(<path>)`` (the path). Values
are compared with the same trace run through the nnqueue client on the same worker (which
tests/client/test_end_to_end.py compares with an in-process engine).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import websocket

from nnqueue.client import Client
from nnqueue.db.models import Job, JobStatus
from nnqueue.embedded import ApiServer
from nnqueue.scheduler import registry
from nnqueue.settings import Settings
from tests.utils.engines import InProcessEngine
from tests.utils.reference import InProcessBackend
from tests.utils.services import Services, WorkerProcess

# A real worker process behind a real API server: the shared one.
pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]

PROMPT = "The Eiffel Tower is in"
PROMPTS = ["The Eiffel Tower is in", "A job queue runs many traces"]


@pytest.fixture(scope="module")
def worker(path_worker: WorkerProcess) -> WorkerProcess:
    return path_worker


def nnqueue_saves(client: Client, model: Any, two_invokes: bool = False) -> dict[str, Any]:
    """The reference: the same trace through the nnqueue client on the same worker."""
    backend = client.backend(model_key=model.to_model_key().split(":", 1)[1], progress=False)
    if two_invokes:
        with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
            with tracer.invoke(PROMPTS[0]):
                first = model.logits.save()
            with tracer.invoke(PROMPTS[1]):
                second = model.logits.save()
        return {"first": first, "second": second}
    with model.trace(PROMPT, max_tokens=2, temperature=0.0, backend=backend):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()
    return {"hidden": hidden, "logits": logits}


def assert_same(got: Any, want: Any) -> None:
    import torch

    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for got_item, want_item in zip(got, want, strict=True):
            torch.testing.assert_close(got_item, want_item, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- remote=True ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_a_blocking_remote_trace_gives_the_queued_values_in_the_callers_variables(
    compress: bool,
    ndif: Any,
    services: Services,
    worker: WorkerProcess,
    client: Client,
    client_model: Any,
    tiny_model_path: Path,
) -> None:
    ndif.API.COMPRESS = compress  # compressed: the signed API route; not: the store's presigned URL
    model = client_model
    with model.trace(PROMPT, remote=True, max_tokens=2, temperature=0.0):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()
    reference = nnqueue_saves(client, model)
    assert_same(hidden, reference["hidden"])
    assert_same(logits, reference["logits"])
    remote_job = list(client.jobs())[1]  # the one before the reference's
    assert remote_job.info["status"] == "completed" and remote_job.model_key == str(tiny_model_path)
    with services.sessions() as session:
        row = session.get(Job, uuid.UUID(remote_job.id))
        assert row is not None
        # nnsight's version headers, recorded as the nnqueue client's are (named when a rebuild fails).
        assert row.meta["client"] == {"nnsight": "0.8.1", "python": platform.python_version()}
        assert row.meta["ndif"]["compress"] is compress


def test_a_two_invoke_remote_trace(ndif: Any, worker: WorkerProcess, client: Client, client_model: Any) -> None:
    import torch

    model = client_model
    with model.trace(temperature=0.0, max_tokens=1, remote=True) as tracer:
        with tracer.invoke(PROMPTS[0]):
            first = model.logits.save()
        with tracer.invoke(PROMPTS[1]):
            second = model.logits.save()
    reference = nnqueue_saves(client, model, two_invokes=True)
    assert_same(first, reference["first"])
    assert_same(second, reference["second"])
    assert not torch.equal(first, second)


def test_a_user_error_is_raised_with_its_type_and_traceback(
    ndif: Any, worker: WorkerProcess, client_model: Any
) -> None:
    from nnsight.intervention.backends.remote import RemoteError

    model = client_model
    with pytest.raises(RemoteError) as caught:
        with model.trace(PROMPT, remote=True, max_tokens=1, temperature=0.0):
            hidden = model.model.layers[0].output[0]
            raise ValueError(f"user code broke on a tensor of shape {tuple(hidden.shape)}")
    message = str(caught.value)
    assert message.startswith("ValueError: user code broke on a tensor of shape (")
    assert "\n\nIntervention traceback:\n" in message and "raise ValueError" in message


def test_a_non_blocking_remote_trace_is_polled_until_its_result(
    ndif: Any, worker: WorkerProcess, client: Client, client_model: Any
) -> None:
    from nnsight.intervention.backends.remote import RemoteBackend

    model = client_model
    backend = RemoteBackend(model.to_model_key(), blocking=False)
    with model.trace(PROMPT, backend=backend, max_tokens=2, temperature=0.0):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()
    assert backend.job_id is not None
    saves = None
    deadline = time.monotonic() + 120
    while saves is None:
        assert time.monotonic() < deadline, f"job {backend.job_id} still {backend.status}"
        saves = backend()  # polls GET /response/{id}: None until COMPLETED
        time.sleep(0.2)
    reference = nnqueue_saves(client, model)
    assert_same(saves["hidden"], reference["hidden"])
    assert_same(saves["logits"], reference["logits"])
    assert client.job(backend.job_id).info["status"] == "completed"


def test_the_async_backend_awaits_the_result(
    ndif: Any, worker: WorkerProcess, client: Client, client_model: Any
) -> None:
    from nnsight.intervention.backends.remote import AsyncRemoteBackend

    model = client_model
    backend = AsyncRemoteBackend(model.to_model_key())
    with model.trace(PROMPT, backend=backend, max_tokens=2, temperature=0.0):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()

    async def wait() -> Any:
        return await backend

    saves = asyncio.run(wait())
    reference = nnqueue_saves(client, model)
    assert_same(saves["logits"], reference["logits"])


def test_a_bad_key_an_unserved_model_and_a_language_model_are_refused_with_reasons(
    ndif: Any, secret: str, worker: WorkerProcess, client_model: Any, tiny_model_path: Path
) -> None:
    from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

    model = client_model
    ndif.API.APIKEY = "nnq_not-a-key"
    # Refused at the subscription's handshake, before the trace is sent; the client shows the server's reason.
    with pytest.raises(websocket.WebSocketBadStatusException, match=r"401 Unauthorized.*unknown API key"):
        with model.trace(PROMPT, remote=True, max_tokens=1):
            logits = model.logits.save()
    ndif.API.APIKEY = secret

    cases = {
        "nnsight.modeling.vllm.vllm.VLLM:no-such-model": "no live worker serves model 'no-such-model'",
        "nnsight.modeling.transformers.TransformersModel:"
        + json.dumps({"repo_id": str(tiny_model_path), "revision": None, "task": "text-generation"}): (
            "is served here by a vllm engine, which cannot run nnsight LanguageModel traces"
        ),
    }
    for key, reason in cases.items():
        with pytest.raises(RemoteError, match="Failed to send request: ") as refused:
            with model.trace(PROMPT, backend=RemoteBackend(key, api_key=None), max_tokens=1):
                logits = model.logits.save()
        assert reason in str(refused.value)


def test_a_remote_session_runs_as_one_job_equal_to_the_local_session(
    ndif: Any, worker: WorkerProcess, client_model: Any, inprocess_engine: InProcessEngine
) -> None:
    """``model.session(remote=True)`` (compressed, as nnsight sends by default): its traces pass a value on the
    server, as the same session passes it on nnsight's own engine (tests/engines/test_sessions.py: the rest)."""
    import torch

    model = client_model
    results = []
    for backend in (None, InProcessBackend(inprocess_engine)):
        kwargs = {"max_tokens": 1, "temperature": 0.0, **({"backend": backend} if backend else {})}
        with model.session(remote=backend is None):
            with model.trace(PROMPT, **kwargs):
                clean = model.model.layers[1].output[0].save()
            with model.trace("A job queue runs many traces", **kwargs):
                model.model.layers[1].output[0][:] = clean.mean(0)
                logits = model.logits.save()
        results.append((clean, logits))
    (remote_clean, remote_logits), (local_clean, local_logits) = results
    assert torch.equal(remote_clean, local_clean) and torch.equal(remote_logits, local_logits)


def test_a_payload_over_the_limit_is_refused_even_when_it_compresses_under_it(
    ndif: Any, services: Services, worker: WorkerProcess, client_model: Any
) -> None:
    from nnsight.intervention.backends.remote import RemoteError

    small = ApiServer(Settings(_env_file=None, **{**services.settings.model_dump(), "max_payload_bytes": 4096}))
    try:
        ndif.API.HOST = f"{small.url}/ndif"
        for compress in (False, True):
            ndif.API.COMPRESS = compress
            # Compressed, the blob is under the limit: it is its decompressed size that is refused.
            reason = "it decompresses to more than 4096 bytes" if compress else "the limit is 4096 bytes"
            with pytest.raises(RemoteError, match=f"payload too large: {reason}"):
                with model_trace(client_model):
                    logits = client_model.logits.save()
    finally:
        small.stop()


def model_trace(model: Any) -> Any:
    # A long prompt: its tokens travel in the payload, so it compresses well but is larger than 4 KiB raw.
    return model.trace("the queue " * 600, remote=True, max_tokens=1)


def slow_trace(model: Any, **kwargs: Any) -> None:
    with model.trace(PROMPT, temperature=0.0, max_tokens=200, ignore_eos=True, **kwargs) as tracer:
        for _ in tracer.iter[:]:
            time.sleep(0.1)
            model.logits
        last = model.logits.save()


def test_a_cancelled_job_ends_its_subscription_with_an_error(
    ndif: Any, worker: WorkerProcess, client: Client, client_model: Any
) -> None:
    from nnsight.intervention.backends.remote import RemoteError

    failure: list[BaseException] = []

    def run() -> None:
        try:
            slow_trace(client_model, remote=True)  # about 20 s unless cancelled
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            failure.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    job = wait_for_running(client)
    job.cancel()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(failure[0], RemoteError) and str(failure[0]).startswith("JobCancelled: ")


def wait_for_running(client: Client, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = list(client.jobs(status="running"))
        if running:
            return running[0]
        time.sleep(0.1)
    raise AssertionError("no job started running")


def test_a_client_that_leaves_cancels_its_job(
    ndif: Any, worker: WorkerProcess, client: Client, client_model: Any
) -> None:
    from nnsight.intervention.backends.remote import AsyncRemoteBackend

    backend = AsyncRemoteBackend(client_model.to_model_key())
    slow_trace(client_model, backend=backend)  # submitted; nobody awaits it
    job = wait_for_running(client)
    backend.close()
    deadline = time.monotonic() + 30
    while job.status() != "cancelled":
        assert time.monotonic() < deadline, f"job {job.id} is still {job.info['status']}"
        time.sleep(0.2)


def test_a_subscription_ends_when_its_models_workers_are_gone(
    ndif: Any, services: Services, worker: WorkerProcess, client: Client, client_model: Any
) -> None:
    from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

    # A worker row nobody keeps fresh: the model is served at submit, then its heartbeat goes stale (3 s); an API
    # that waits 10 s for a restarted worker (NNQUEUE_WORKER_RESTART_GRACE_S) then cancels the job.
    impatient = ApiServer(Settings(_env_file=None, **{**services.settings.model_dump(), "worker_restart_grace_s": 10}))
    registry.register(services.sessions, registry.new_worker_id(), "ghost-model", "nobody-consumes-this", 1)
    started = time.monotonic()
    try:
        ndif.API.HOST = f"{impatient.url}/ndif"
        with pytest.raises(RemoteError, match=r"JobCancelled: .* no live worker has served model 'ghost-model'"):
            with client_model.trace(
                PROMPT, backend=RemoteBackend("nnsight.modeling.vllm.vllm.VLLM:ghost-model"), max_tokens=1
            ):
                logits = client_model.logits.save()
    finally:
        impatient.stop()
    assert time.monotonic() - started < 60
    with services.sessions() as session:
        [job] = session.query(Job).filter(Job.model_key == "ghost-model").all()
        assert job.status is JobStatus.CANCELLED


SCRIPT = """
from nnsight.modeling.vllm import VLLM
from nnqueue.engines.platform import prepare_process
import sys

prepare_process()
model = VLLM(sys.argv[1], dtype="float32", max_model_len=256, seed=0)
with model.trace("The Eiffel Tower is in", remote=True, max_tokens=1, temperature=0.0):
    logits = model.logits.save()
print("logits", tuple(logits.shape))
"""


def test_users_only_set_ndif_host_and_ndif_api_key(
    api_server: ApiServer, secret: str, worker: WorkerProcess, tiny_model_path: Path, tmp_path: Path
) -> None:
    script = tmp_path / "remote_trace.py"
    script.write_text(SCRIPT)
    env = {name: value for name, value in os.environ.items() if not name.startswith(("NNQUEUE_", "NDIF_"))}
    env.update({"NDIF_HOST": f"{api_server.url}/ndif", "NDIF_API_KEY": secret})
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "logits (1, 512)" in done.stdout or "logits (512,)" in done.stdout, done.stdout


# -- serve= ------------------------------------------------------------------------------------------------


def serve_url(api_server: ApiServer, tiny_model_path: Path) -> str:
    return f"{api_server.url}/ndif/serve/{tiny_model_path}"


def test_serve_runs_a_trace_and_reraises_its_error(
    api_server: ApiServer, secret: str, worker: WorkerProcess, client: Client, client_model: Any, tiny_model_path: Path
) -> None:
    model = client_model
    url = serve_url(api_server, tiny_model_path)
    with model.trace(PROMPT, serve=url, api_key=secret, max_tokens=2, temperature=0.0):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()
    reference = nnqueue_saves(client, model)
    assert_same(hidden, reference["hidden"])
    assert_same(logits, reference["logits"])

    with pytest.raises(RuntimeError) as caught:
        with model.trace(PROMPT, serve=url, api_key=secret, max_tokens=1):
            model.model.layers[0].output
            raise KeyError("no such feature")
    assert str(caught.value).startswith("KeyError: 'no such feature'")
    assert "Intervention traceback:" in str(caught.value)


def test_serve_refuses_a_bad_key_and_engine_wide_edits_and_reports_health(
    api_server: ApiServer, secret: str, worker: WorkerProcess, client_model: Any, tiny_model_path: Path
) -> None:
    url = serve_url(api_server, tiny_model_path)
    with pytest.raises(ConnectionError, match="nnsight-serve returned 401: unknown API key"):
        with client_model.trace(PROMPT, serve=url, api_key="nnq_wrong", max_tokens=1):
            logits = client_model.logits.save()
    with pytest.raises(ConnectionError, match="nnsight-serve returned 401: missing API key"):
        with client_model.trace(PROMPT, serve=url, max_tokens=1):
            logits = client_model.logits.save()

    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    unserved = httpx.get(f"{api_server.url}/ndif/serve/no-such-model/health")
    assert unserved.status_code == 503 and "no live vLLM worker serves 'no-such-model'" in unserved.json()["detail"]
    refused = httpx.post(f"{url}/v1/nnsight/register/edit-1", headers={"ndif-api-key": secret}, content=b"x")
    assert refused.status_code == 403 and "refused" in refused.json()["detail"]


def test_the_subscription_streams_nnqueues_job_states(ndif: Any, worker: WorkerProcess, client_model: Any) -> None:
    from nnsight.intervention.backends.remote import AsyncRemoteBackend

    backend = AsyncRemoteBackend(client_model.to_model_key())
    with client_model.trace(PROMPT, temperature=0.0, max_tokens=30, ignore_eos=True, backend=backend) as tracer:
        first = client_model.logits.save()
        for _ in tracer.iter[1:]:
            time.sleep(0.1)  # about 3 s: long enough for the progress to be written
            client_model.logits

    async def updates() -> list[Any]:
        return [update async for update in backend]  # nnsight's raw status stream, then the saves

    *statuses, saves = asyncio.run(updates())
    seen = [(update.status.value, update.description) for update in statuses]
    assert seen[-1][0] == "COMPLETED" and set(saves) == {"first"}
    assert {status for status, _ in seen} <= {"QUEUED", "DISPATCHED", "RUNNING", "COMPLETED"}
    assert ("RUNNING", "0/1 invokes") in seen, seen
    assert len(seen) == len(set(seen))  # an update only when something changed
