"""Through the API to a real worker and back: the downloaded result equals the same trace run in-process.

The session's shared ``nnqueue worker`` process serves the tiny model. Results live in S3 (SeaweedFS,
which checks signatures and expiry), so downloads go through presigned URLs by default.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from nnqueue.storage.results import load_result
from nnqueue.workers.engine_liveness import INTERVAL_S
from tests.api.test_metrics import scrape
from tests.api.test_metrics import value as sample
from tests.utils.api import Api, api_client
from tests.utils.payloads import PrebuiltBackend
from tests.utils.reference import reference_saves
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]  # end to end: a real worker process (the shared one)

PROMPT = "The Eiffel Tower is in"
ROOT = Path(__file__).resolve().parents[2]


def client_versions() -> dict[str, str]:
    """What a client submitting from this process declares: its nnsight's and Python's versions."""
    import nnsight

    return {"nnsight": nnsight.__version__, "python": platform.python_version()}


@pytest.fixture(scope="module")
def worker_metrics_port(worker: WorkerProcess) -> int:
    """The shared worker's metrics port (it logs JSON too)."""
    return int(worker.env["NNQUEUE_WORKER_METRICS_PORT"])


@pytest.fixture(scope="module")
def alice(api: Api) -> dict[str, str]:
    return api.new_key("alice")


def hidden_and_logits(model: Any, backend: Any) -> None:
    with model.trace(PROMPT, temperature=0.0, max_tokens=1, backend=backend):
        out = model.model.layers[0].output
        hidden = (out[0] + out[1]).save()  # vLLM's Llama layer returns (mlp_out, residual)
        logits = model.logits.save()


@pytest.fixture(scope="module")
def payload(client_model: Any) -> bytes:
    backend = PrebuiltBackend()
    hidden_and_logits(client_model, backend)
    return backend.payload


@pytest.fixture(scope="module")
def completed(api: Api, worker: WorkerProcess, alice: dict[str, str], payload: bytes) -> dict[str, Any]:
    job = api.submit_ok(alice, payload, model_key=MODEL_KEY, timeout_s=120, client=client_versions(), safetensors=True)
    done = wait_ended(api, alice, job["id"])
    assert done["status"] == "completed", done["error"]
    return done


def wait_ended(api: Api, headers: dict[str, str], job_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.http.get(f"/v1/jobs/{job_id}", headers=headers).json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not end in {timeout} s")


def test_models_shows_the_running_worker(api: Api, worker: WorkerProcess, alice: dict[str, str]) -> None:
    listed = api.http.get("/v1/models", headers=alice).json()["models"]
    models = [model for model in listed if model["model_key"] == MODEL_KEY]  # the shared services serve others too
    (versions,) = [model.pop("weights_versions") for model in models]
    [model] = models  # domains: those its engines serve traces of now (none before its first trace)
    assert {key: value for key, value in model.items() if key != "domains"} == {
        "model_key": MODEL_KEY,
        "workers": 1,
        "capacity": 4,
        "engine": "vllm",
        "taps": None,
    }
    assert isinstance(model["domains"], list)
    (version,) = versions  # the checkpoint's base version, served by the one worker
    assert version.startswith("base-") and versions[version] == 1


def test_the_presigned_download_equals_an_in_process_run(
    api: Api, alice: dict[str, str], completed: dict[str, Any], client_model: Any, inprocess_engine: Any
) -> None:
    import torch
    from safetensors.torch import load as safetensors_load

    assert completed["result"]["format"] == "torch+safetensors"
    assert completed["progress"] == {"done": 1, "total": 1} and completed["attempts"] == 1
    assert completed["started_at"] <= completed["finished_at"] and completed["queue_position"] is None

    redirect = api.http.get(f"/v1/jobs/{completed['id']}/result", headers=alice, follow_redirects=False)
    assert redirect.status_code == 302
    url = redirect.headers["location"]
    assert url.startswith(api.resources.settings.s3.endpoint_url) and "X-Amz-Expires=3600" in url
    downloaded = httpx.get(url)  # no API key: the URL itself is the credential
    assert downloaded.status_code == 200 and len(downloaded.content) == completed["result"]["size"]
    saves = load_result(downloaded.content)

    reference = reference_saves(client_model, inprocess_engine, hidden_and_logits)
    assert set(saves) == set(reference) == {"hidden", "logits"}
    for name, value in reference.items():
        assert torch.equal(saves[name], value), name

    url = api.http.get(
        f"/v1/jobs/{completed['id']}/result", headers=alice, params={"format": "safetensors"}, follow_redirects=False
    ).headers["location"]
    tensors = safetensors_load(httpx.get(url).content)
    for name, value in saves.items():
        torch.testing.assert_close(tensors[name], value)


def test_the_safetensors_copy_is_written_only_when_asked(
    api: Api, worker: WorkerProcess, alice: dict[str, str], payload: bytes
) -> None:
    job = wait_ended(api, alice, api.submit_ok(alice, payload, model_key=MODEL_KEY, timeout_s=120)["id"])
    assert job["status"] == "completed" and job["result"]["format"] == "torch" and job["result"]["safetensors"] is None
    refused = api.http.get(f"/v1/jobs/{job['id']}/result", headers=alice, params={"format": "safetensors"})
    assert refused.status_code == 409 and "submit it with safetensors" in refused.json()["detail"]
    assert api.http.get(f"/v1/jobs/{job['id']}/result", headers=alice, params={"inline": 1}).status_code == 200


def test_inline_download_streams_the_same_bytes(api: Api, alice: dict[str, str], completed: dict[str, Any]) -> None:
    url = f"/v1/jobs/{completed['id']}/result"
    inline = api.http.get(url, headers=alice, params={"inline": 1})
    assert inline.status_code == 200 and inline.headers["content-type"] == "application/octet-stream"
    assert int(inline.headers["content-length"]) == completed["result"]["size"]
    assert inline.headers["content-disposition"] == f'attachment; filename="{completed["id"]}.pt"'
    presigned = api.http.get(url, headers=alice, follow_redirects=False).headers["location"]
    assert inline.content == httpx.get(presigned).content


def test_a_presigned_url_expires(services: Services, alice: dict[str, str], completed: dict[str, Any]) -> None:
    with api_client(services, result_url_expiry_s=3) as short:
        issued = time.monotonic()
        url = short.http.get(f"/v1/jobs/{completed['id']}/result", headers=alice, follow_redirects=False).headers[
            "location"
        ]
    assert "X-Amz-Expires=3" in url
    assert httpx.get(url).status_code == 200  # valid while fresh...
    time.sleep(max(0.0, issued + 4.5 - time.monotonic()))
    expired = httpx.get(url)
    assert expired.status_code == 403, expired.text  # ...and S3 refuses it once it has expired
    assert "expired" in expired.text.lower()


def test_another_owner_cannot_download_or_cancel_it(api: Api, completed: dict[str, Any], alice: dict[str, str]) -> None:
    bob = api.new_key("bob")
    for path in ("/result", "/result?inline=1", ""):
        assert api.http.get(f"/v1/jobs/{completed['id']}{path}", headers=bob).status_code == 404
    assert api.http.post(f"/v1/jobs/{completed['id']}/cancel", headers=bob).status_code == 404
    ended = api.http.post(f"/v1/jobs/{completed['id']}/cancel", headers=alice)
    assert ended.status_code == 409 and "is completed" in ended.json()["detail"]


def test_an_error_in_user_code_is_reported_on_the_job(
    api: Api, worker: WorkerProcess, alice: dict[str, str], client_model: Any
) -> None:
    backend = PrebuiltBackend()
    with client_model.trace(PROMPT, temperature=0.0, max_tokens=1, backend=backend):
        hidden = client_model.model.layers[0].output[0]
        raise ValueError(f"user code broke on shape {tuple(hidden.shape)}")
    job = api.submit_ok(alice, backend.payload, model_key=MODEL_KEY, client=client_versions())

    failed = wait_ended(api, alice, job["id"])
    assert failed["status"] == "failed" and failed["result"] is None
    assert failed["error"]["type"] == "ValueError"
    assert "user code broke on shape" in failed["error"]["message"]
    assert "raise ValueError" in failed["error"]["traceback"]
    refused = api.http.get(f"/v1/jobs/{job['id']}/result", headers=alice)  # it saved nothing: no result
    assert refused.status_code == 409 and "is failed" in refused.json()["detail"]


def test_the_workers_metrics_and_json_logs_follow_its_jobs(
    api: Api, worker: WorkerProcess, worker_metrics_port: int, alice: dict[str, str], payload: bytes
) -> None:
    """The worker's own series (jobs, queue wait, run time, result bytes) and its engine's vLLM token counter
    move with a job; its JSON log lines about that job carry the job's id."""

    def worker_metrics() -> dict[Any, float]:
        return scrape(httpx.get(f"http://127.0.0.1:{worker_metrics_port}/metrics").text)

    trace = {"model": MODEL_KEY, "kind": "trace"}
    before = worker_metrics()
    job = api.submit_ok(alice, payload, model_key=MODEL_KEY, timeout_s=120)
    assert wait_ended(api, alice, job["id"])["status"] == "completed"
    after = worker_metrics()
    moved = lambda name, **labels: sample(after, name, **labels) - sample(before, name, **labels)  # noqa: E731
    assert moved("nnqueue_jobs_finished_total", **trace, status="completed") == 1
    assert moved("nnqueue_job_queue_wait_seconds_count", **trace) == 1
    assert moved("nnqueue_job_run_seconds_count", **trace, status="completed") == 1
    assert moved("nnqueue_job_run_seconds_sum", **trace, status="completed") > 0
    assert moved("nnqueue_store_bytes_written_total", what="result") > 0
    generated = sum(v for (name, _), v in after.items() if name == "vllm:generation_tokens_total")
    assert generated >= 1, "the engine's vLLM token counter is not exported"
    assert sample(after, "nnqueue_worker_running_jobs", model=MODEL_KEY) == 0

    lines = [json.loads(line) for line in worker.log().splitlines() if line.startswith("{")]
    # The worker's own records (a child's relayed line, nnqueue.output, carries no job context)
    about_job = [line for line in lines if job["id"] in line["message"] and line["logger"] != "nnqueue.output"]
    assert about_job and all(line.get("job_id") == job["id"] for line in about_job)


def test_the_dashboard_and_readme_queries_name_exported_series(
    api: Api, worker: WorkerProcess, worker_metrics_port: int, completed: dict[str, Any]
) -> None:
    """Every series that docker/grafana-dashboard.json, the metrics page's PromQL and the runbook's alert rules use
    is exported by the API or a worker."""
    exported = {
        name
        for text in (api.http.get("/metrics").text, httpx.get(f"http://127.0.0.1:{worker_metrics_port}/metrics").text)
        for name, _labels in scrape(text)
    }
    root = Path(__file__).resolve().parents[2]
    dashboard = json.loads((root / "docker" / "grafana-dashboard.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    [promql] = re.findall(r"```promql\n(.*?)```", (root / "docs" / "operator" / "metrics.md").read_text(), re.S)
    [alerts] = re.findall(r"```yaml\n(.*?)```", (root / "docs" / "operator" / "runbook.md").read_text(), re.S)
    queries += [line.split("#")[0] for line in promql.splitlines() + alerts.splitlines()]
    used = {name for query in queries for name in re.findall(r"\b(?:nnqueue_|vllm:)[A-Za-z0-9_:]+", query)}
    assert len(used) >= 10 and used <= exported, used - exported


def liveness_probe(port: int, older_than_s: float) -> int:
    """The exit status of the workers' Kubernetes liveness probe (deploy/kubernetes/base/worker.yaml), run against this
    worker's metrics with the given age limit."""
    manifests = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "base" / "worker.yaml").read_text())
    [deployment] = [obj for obj in manifests if obj["kind"] == "Deployment"]
    command = deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"] and "127.0.0.1:9100" in command[2] and "> 600)" in command[2]
    code = command[2].replace("127.0.0.1:9100", f"127.0.0.1:{port}").replace("> 600)", f"> {older_than_s})")
    return subprocess.run([sys.executable, "-c", code], timeout=60).returncode


def test_a_hung_engine_fails_the_liveness_probe_and_a_live_one_passes(
    worker: WorkerProcess, worker_metrics_port: int
) -> None:
    """The probe passes while the engine answers; with its core process stopped (SIGSTOP, as a step that never ends
    would leave it) the stamp ages and the probe fails; resumed, it passes again. Last in the module: it pauses the
    module's worker's engine."""
    assert liveness_probe(worker_metrics_port, 600) == 0
    [core] = [p for p in worker.children() if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    core.suspend()
    try:
        deadline = time.monotonic() + 180
        while liveness_probe(worker_metrics_port, 3 * INTERVAL_S) == 0:
            assert time.monotonic() < deadline, "the engine's stamp kept moving with its core stopped"
            time.sleep(2)
    finally:
        core.resume()
    deadline = time.monotonic() + 180
    while liveness_probe(worker_metrics_port, 3 * INTERVAL_S) != 0:
        assert time.monotonic() < deadline, "the engine's stamp did not move again once its core resumed"
        time.sleep(2)
