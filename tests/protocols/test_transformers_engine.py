"""The transformers engine: nnsight ``LanguageModel`` traces (what NDIF runs) on a worker holding the tiny Llama
in Hugging Face transformers, through the nnqueue client and through nnsight's own ``remote=True``, with
values equal to the same trace run locally on the same checkpoint, a gradient included."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nnqueue.client import Client, JobFailed
from nnqueue.scheduler import registry
from tests.utils.services import Services, WorkerProcess
from tests.utils.snooping import UNPROTECTED, assert_no_secret, engine_uid

pytestmark = pytest.mark.slow  # a real worker process behind a real API server

PROMPT = "The Eiffel Tower is in"


@pytest.fixture(scope="module")
def services(services: Services) -> Services:
    """A stall timeout of 10 s, not the suite's 3 s: a first backward pass on a loaded two-core machine took longer
    than 3 s in one switch (the endless loop below still stalls)."""
    services.env["NNQUEUE_ENGINE_STALL_TIMEOUT_S"] = "10"
    return services


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess], tiny_model_path: Path) -> WorkerProcess:
    return start_worker(model_key=str(tiny_model_path), engine="transformers")


@pytest.fixture(scope="module")
def models(tiny_model_path: Path) -> Iterator[tuple[Any, Any]]:
    """A meta LanguageModel (what a client writes against: no weights) and a loaded one (the local run)."""
    from nnsight import LanguageModel
    from nnsight.modeling import huggingface

    # nnsight's client canonicalizes a repo id through the Hub to build its remote key; a local path has
    # none to ask, so it is given as its own canonical id (what the Hub would answer for a repo id).
    huggingface._ID_CACHE[str(tiny_model_path)] = str(tiny_model_path)
    yield LanguageModel(str(tiny_model_path)), LanguageModel(str(tiny_model_path), dispatch=True)
    huggingface._ID_CACHE.pop(str(tiny_model_path), None)


def gradient_trace(model: Any, **kwargs: Any) -> dict[str, Any]:
    with model.trace(PROMPT, **kwargs):
        hidden = model.model.layers[0].output
        saved_hidden = hidden.save()
        logits = model.lm_head.output.save()
        loss = model.lm_head.output[0, -1].logsumexp(-1)
        with loss.backward():
            grad = hidden.grad.save()
    return {"hidden": saved_hidden, "logits": logits, "grad": grad}


def two_invokes(model: Any, **kwargs: Any) -> dict[str, Any]:
    with model.trace(**kwargs) as tracer:
        with tracer.invoke(PROMPT):
            first = model.lm_head.output[:, -1].save()
        with tracer.invoke("A job queue runs many traces"):
            model.model.layers[1].output[:] = 0  # an edit, in this invoke only
            second = model.lm_head.output[:, -1].save()
    return {"first": first, "second": second}


def assert_equal_saves(got: dict[str, Any], want: dict[str, Any]) -> None:
    import torch

    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)


def test_language_model_traces_through_the_nnqueue_client_equal_a_local_run(
    client: Client, worker: WorkerProcess, models: tuple[Any, Any], tiny_model_path: Path
) -> None:
    meta, local = models
    backend = client.backend(
        progress=False, safetensors=True
    )  # the model key: the LanguageModel's repo id (here its path)
    assert_equal_saves(gradient_trace(meta, backend=backend), gradient_trace(local))
    assert backend.job is not None and backend.job.model_key == str(tiny_model_path)
    assert backend.job.info["result"]["format"] == "torch+safetensors"
    assert_equal_saves(two_invokes(meta, backend=backend), two_invokes(local))
    (model,) = client.models()
    assert {key: model[key] for key in ("model_key", "workers", "capacity", "engine", "taps")} == {
        "model_key": str(tiny_model_path),
        "workers": 1,
        "capacity": 1,
        "engine": "transformers",
        "taps": None,
    }


def test_language_model_traces_and_sessions_through_nnsights_remote_equal_a_local_run(
    ndif: Any, worker: WorkerProcess, models: tuple[Any, Any]
) -> None:
    meta, local = models
    for compress in (True, False):
        ndif.API.COMPRESS = compress
        assert_equal_saves(gradient_trace(meta, remote=True), gradient_trace(local))
    assert_equal_saves(two_invokes(meta, remote=True), two_invokes(local))

    def session(model: Any, **kwargs: Any) -> dict[str, Any]:
        with model.session(**kwargs):
            with model.trace(PROMPT):
                hidden = model.model.layers[0].output
            with model.trace(PROMPT):
                model.model.layers[0].output[:] = hidden * 2  # a value from the first trace, in the second
                patched = model.lm_head.output.save()
        return {"patched": patched}

    assert_equal_saves(session(meta, remote=True), session(local))


def test_a_user_error_fails_the_job_with_its_type_and_the_engine_goes_on(
    client: Client, ndif: Any, worker: WorkerProcess, models: tuple[Any, Any]
) -> None:
    from nnsight.intervention.backends.remote import RemoteError

    meta, local = models
    with pytest.raises(JobFailed) as caught:
        with meta.trace(PROMPT, backend=client.backend(progress=False)):
            hidden = meta.model.layers[0].output
            raise ValueError(f"user code broke on {tuple(hidden.shape)}")
    assert caught.value.type_name == "ValueError" and str(caught.value) == "user code broke on (1, 6, 128)"
    # As a local LanguageModel trace raises it: the ValueError, not nnsight's vLLM RuntimeError.
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, RuntimeError)
    assert "raise ValueError" in caught.value.traceback and "nnsight/" not in caught.value.traceback

    with pytest.raises(RemoteError, match=r"^ZeroDivisionError: division by zero"):
        with meta.trace(PROMPT, remote=True):
            meta.model.layers[0].output
            1 / 0
    assert_equal_saves(gradient_trace(meta, remote=True), gradient_trace(local))


def test_a_job_over_its_timeout_is_stopped_and_the_next_one_runs(
    client: Client, worker: WorkerProcess, models: tuple[Any, Any]
) -> None:
    meta, local = models
    backend = client.backend(progress=False, timeout_s=3)
    started = time.monotonic()
    with pytest.raises(JobFailed) as caught:
        with meta.trace(PROMPT, backend=backend):
            meta.model.layers[0].output
            time.sleep(60)  # not a stall (the watchdog's 10 s is per switch, and this is one): the timeout stops it
    assert caught.value.type_name in ("JobTimeout", "InterventionStalled")
    assert time.monotonic() - started < 45
    assert_equal_saves(gradient_trace(meta, backend=client.backend(progress=False)), gradient_trace(local))


def test_an_endless_loop_is_stopped_by_the_stall_watchdog_and_the_engine_goes_on(
    client: Client, worker: WorkerProcess, models: tuple[Any, Any]
) -> None:
    meta, local = models
    started = time.monotonic()
    with pytest.raises(JobFailed) as caught:
        with meta.trace(PROMPT, backend=client.backend(progress=False)):
            meta.model.layers[0].output
            while True:  # NNQUEUE_ENGINE_STALL_TIMEOUT_S is 10 s here; the job's timeout is the default 600 s
                pass
    assert caught.value.type_name == "InterventionStalled" and time.monotonic() - started < 60
    assert_equal_saves(two_invokes(meta, backend=client.backend(progress=False)), two_invokes(local))


def test_vllm_traces_are_refused_for_a_transformers_model_and_engines_do_not_share_a_key(
    ndif: Any, services: Services, worker: WorkerProcess, client_model: Any, tiny_model_path: Path
) -> None:
    from nnsight.intervention.backends.remote import RemoteBackend, RemoteError

    key = f"nnsight.modeling.vllm.vllm.VLLM:{tiny_model_path}"
    with pytest.raises(RemoteError, match="served here by a transformers engine, which cannot run nnsight VLLM"):
        with client_model.trace(PROMPT, backend=RemoteBackend(key), max_tokens=1):
            logits = client_model.logits.save()
    with pytest.raises(registry.EngineConflict, match="a transformers engine already serve"):
        registry.register(
            services.sessions,
            registry.new_worker_id(),
            str(tiny_model_path),
            "q",
            1,
            stale_after_s=services.settings.worker_stale_after_s,
        )
    language_key = "nnsight.modeling.transformers.TransformersModel:" + json.dumps(
        {"repo_id": str(tiny_model_path), "revision": None, "task": "text-classification"}
    )
    with pytest.raises(RemoteError, match="task 'text-classification' is not served"):
        with client_model.trace(PROMPT, backend=RemoteBackend(language_key), max_tokens=1):
            logits = client_model.logits.save()


def test_an_import_of_os_in_a_language_model_trace_fails_the_job_naming_it(
    client: Client, worker: WorkerProcess, models: tuple[Any, Any]
) -> None:
    import nnsight

    meta, local = models
    with pytest.raises(JobFailed, match="module 'os' is not allowed in intervention code"):
        with meta.trace(PROMPT, backend=client.backend(progress=False)):
            import os as stolen

            environment = nnsight.save(dict(stolen.environ))
            meta.lm_head.output
    assert_equal_saves(two_invokes(meta, backend=client.backend(progress=False)), two_invokes(local))


def test_a_root_workers_transformers_engine_runs_as_the_engine_user_without_the_workers_secrets(
    client: Client, services: Services, start_worker: Callable[..., WorkerProcess], models: tuple[Any, Any]
) -> None:
    import nnsight

    # Without the protected environment, the trace runs arbitrary code, as a sandbox escape would.
    worker = start_worker(model_key="tiny-hf-root", engine="transformers", env=UNPROTECTED)
    meta, _ = models
    worker_pid = worker.wait_registered().pid
    with meta.trace(PROMPT, backend=client.backend("tiny-hf-root", progress=False)):
        import os

        def read(path: str) -> str:
            try:
                with open(path, "rb") as file:
                    return file.read().decode(errors="replace")
            except OSError as error:
                return f"{type(error).__name__}: {error}"

        found = nnsight.save(
            {
                "environ": {key: value for key, value in os.environ.items() if "NNQUEUE" in key or "AWS" in key},
                "worker": read(f"/proc/{worker_pid}/environ"),
                "uid": os.getuid(),
            }
        )
        meta.lm_head.output
    assert_no_secret(found, services)
    # The engine user, or root kept where that user cannot use this Python (the worker registered which): either
    # way the worker's /proc environ is out of reach (the worker is non-dumpable).
    assert found["uid"] == engine_uid(worker) and "PermissionError" in found["worker"]


LIGHT_CLIENT = """
import sys
from nnsight import LanguageModel
from nnsight.modeling import huggingface
from nnqueue.client import Client
import torch

url, key, path, out = sys.argv[1:]
huggingface._ID_CACHE[path] = path
model = LanguageModel(path)
with Client(url, key) as client:
    backend = client.backend(blocking=False)
    with model.trace("The Eiffel Tower is in", backend=backend):
        logits = model.lm_head.output.save()
    backend.job.wait(timeout=120, progress=False)
    backend.job.download(out, progress=False)
from nnqueue.cli import SERVER_MODULES
print("server modules imported:", sorted(name for name in sys.modules if name.split(".")[0] in SERVER_MODULES))
"""


def test_a_client_install_writes_submits_waits_for_and_downloads_a_language_model_trace(
    api_server: Any, secret: str, worker: WorkerProcess, models: tuple[Any, Any], tiny_model_path: Path, tmp_path: Path
) -> None:
    import torch

    from tests.utils.light_client import run_light

    _, local = models
    done = run_light(LIGHT_CLIENT, api_server.url, secret, str(tiny_model_path), str(tmp_path / "result.pt"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "server modules imported: []" in done.stdout
    with local.trace(PROMPT):
        logits = local.lm_head.output.save()
    saved = torch.load(tmp_path / "result.pt", weights_only=False)
    torch.testing.assert_close(saved["logits"], logits, atol=0, rtol=0)
