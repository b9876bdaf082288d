"""The client against a scripted API (httpx.MockTransport): wire format, errors, redirects, waiting; CLI refusals
that need no API.

No servers: these pin the client's side of the API contract, including what the end-to-end tests cannot
see, such as the API key never travelling to the object store with a presigned download.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import io
import json
import re
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from nnqueue.client import (
    APIConnectionError,
    APIError,
    AuthenticationError,
    Client,
    ConflictError,
    IntegrityError,
    JobCancelled,
    JobFailed,
    NotFoundError,
    PayloadTooLargeError,
    TooManyJobsError,
    UnknownModelError,
)
from nnqueue.client import client as client_module
from nnqueue.client.errors import NNqueueError
from nnqueue.client.job import Job

API = "http://api.test"
JOB_ID = "7c0e7a52-1d0c-4d8e-9f3f-0a9c1b2c3d4e"


def job_json(status: str = "queued", **fields: Any) -> dict[str, Any]:
    return {
        "id": JOB_ID,
        "owner": "alice",
        "model_key": "m",
        "kind": "trace",
        "status": status,
        "priority": 0,
        "timeout_s": 600.0,
        "metadata": {},
        "attempts": 0,
        "created_at": "2026-11-22T08:00:00Z",
        "queued_at": "2026-11-22T08:00:00Z",
        "started_at": None,
        "finished_at": None,
        "queue_position": None,
        "progress": {"done": 0, "total": None},
        "error": None,
        "result": None,
        **fields,
    }


def scripted(handler: Callable[[httpx.Request], httpx.Response]) -> Client:
    return Client(API, "nnq_secret", http_transport=httpx.MockTransport(handler))


def saves_bytes(saves: dict[str, Any]) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(saves, buffer)
    return buffer.getvalue()


def test_submit_sends_the_payload_as_the_body_and_the_spec_in_a_header_with_the_key() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers.get("authorization")
        seen["body"] = request.read()
        seen["type"] = request.headers["content-type"]
        seen["spec"] = request.headers["nnqueue-spec"]
        return httpx.Response(201, json=job_json())

    submitted: list[Job] = []
    client_module.submit_hooks.append(submitted.append)
    try:
        job = scripted(handler).submit("m", b"\x00payload\xff", timeout_s=30, priority=2, metadata={"a": "é"})
    finally:
        client_module.submit_hooks.remove(submitted.append)

    assert job.id == JOB_ID and submitted == [job]
    assert seen["auth"] == "Bearer nnq_secret" and seen["type"] == "application/octet-stream"
    assert seen["body"] == b"\x00payload\xff" and seen["spec"].isascii()
    spec = json.loads(seen["spec"])
    import nnsight

    assert spec["model_key"] == "m" and spec["kind"] == "trace" and spec["priority"] == 2
    assert spec["timeout_s"] == 30 and spec["metadata"] == {"a": "é"}
    assert spec["client"]["nnsight"] == nnsight.__version__ and spec["client"]["python"].count(".") == 2


def _form_spec(body: bytes) -> dict[str, Any]:
    assert b'name="payload"' in body and b"\x00payload\xff" in body
    return json.loads(body.split(b'name="spec"', 1)[1].split(b"\r\n\r\n", 1)[1].split(b"\r\n--", 1)[0])


def test_a_spec_too_long_for_a_header_goes_in_a_multipart_form() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json=job_json())

    metadata = {"notes": "n" * client_module.SPEC_HEADER_MAX_BYTES}
    scripted(handler).submit("m", b"\x00payload\xff", metadata=metadata)
    [request] = seen
    assert request.headers["content-type"].startswith("multipart/form-data") and "nnqueue-spec" not in request.headers
    assert _form_spec(request.read())["metadata"] == metadata


def test_an_api_that_reads_only_forms_gets_one_from_then_on() -> None:
    """An older API reads a raw payload as a form without fields (422, nothing stored): the client sends the form."""
    kinds: list[str] = []

    def older_api(request: httpx.Request) -> httpx.Response:
        kinds.append(request.headers["content-type"].split(";")[0])
        if kinds[-1] != "multipart/form-data":
            missing = [
                {"type": "missing", "loc": ["body", field], "msg": "Field required"} for field in ("spec", "payload")
            ]
            return httpx.Response(422, json={"detail": missing})
        assert _form_spec(request.read())["model_key"] == "m"
        return httpx.Response(201, json=job_json())

    client = scripted(older_api)
    assert client.submit("m", b"\x00payload\xff").id == JOB_ID
    assert client.submit("m", b"\x00payload\xff").id == JOB_ID
    assert kinds == ["application/octet-stream", "multipart/form-data", "multipart/form-data"]


def test_a_422_about_the_payload_itself_is_raised_not_retried_as_a_form() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["content-type"])
        detail = [{"type": "value_error", "loc": ["body", "payload"], "msg": "the payload is neither ..."}]
        return httpx.Response(422, json={"detail": detail})

    with pytest.raises(APIError, match="payload: the payload is neither"):
        scripted(handler).submit("m", b"junk")
    assert calls == ["application/octet-stream"]


@pytest.mark.parametrize(
    ("status", "method", "path", "cls"),
    [
        (401, "GET", f"/v1/jobs/{JOB_ID}", AuthenticationError),
        (404, "GET", f"/v1/jobs/{JOB_ID}", NotFoundError),
        (409, "POST", f"/v1/jobs/{JOB_ID}/cancel", ConflictError),
        (413, "POST", "/v1/jobs", PayloadTooLargeError),
        (429, "POST", "/v1/jobs", TooManyJobsError),
        (400, "POST", "/v1/jobs", UnknownModelError),
        (500, "GET", f"/v1/jobs/{JOB_ID}", APIError),
    ],
)
def test_http_errors_carry_status_and_detail(status: int, method: str, path: str, cls: type[APIError]) -> None:
    client = scripted(lambda request: httpx.Response(status, json={"detail": f"because {status}"}))
    with pytest.raises(cls) as caught:
        client.transport.request(method, path)
    assert type(caught.value) is cls and caught.value.status_code == status
    assert caught.value.detail == f"because {status}" and f"because {status}" in str(caught.value)


def test_a_422_names_the_fields() -> None:
    detail = [{"loc": ["body", "spec", "model_key"], "msg": "Field required", "type": "missing"}]
    client = scripted(lambda request: httpx.Response(422, json={"detail": detail}))
    with pytest.raises(APIError) as caught:
        client.submit("", b"x")
    assert caught.value.status_code == 422 and "spec.model_key: Field required" in str(caught.value)


def test_an_unreachable_api_is_a_connection_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(APIConnectionError, match=re.escape("cannot reach the nnqueue API at http://api.test")):
        scripted(refuse).models()


def test_jobs_follows_the_cursor_across_pages() -> None:
    pages = {None: (["a", "b"], "c1"), "c1": (["c"], "c2"), "c2": ([], None)}
    queries: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        query = dict(request.url.params)
        queries.append(query)
        ids, cursor = pages[query.get("cursor")]
        return httpx.Response(200, json={"jobs": [job_json(id=i) for i in ids], "next_cursor": cursor})

    ids = [job.id for job in scripted(handler).jobs(status="failed", model_key="m", page_size=2)]
    assert ids == ["a", "b", "c"]
    assert queries[0] == {"status": "failed", "model_key": "m", "limit": "2"} and queries[2]["cursor"] == "c2"


def failed_job(type_name: str, traceback: str = "") -> Job:
    """A job the scripted API says FAILED with ``type_name``, waited for (its error not raised)."""
    failed = job_json("failed", error={"type": type_name, "message": "it broke", "traceback": traceback})
    job = scripted(lambda request: httpx.Response(200, json=failed)).job(JOB_ID)
    job.info = failed
    return job


TRACEBACK = '  File "<trace>", line 3, in <module>\n    raise ValueError("bad")\n'


@pytest.mark.parametrize(
    "type_name", ["IndexError", "KeyError", "ModuleNotFoundError", "OSError", "StopIteration", "UnicodeDecodeError"]
)
def test_a_failed_jobs_error_is_its_builtin_type_and_no_other(type_name: str) -> None:
    with pytest.raises(getattr(builtins, type_name)) as caught:
        failed_job(type_name, TRACEBACK).wait(progress=False)
    error = caught.value
    assert isinstance(error, JobFailed) and not isinstance(error, RuntimeError)  # nothing a local error lacks
    added = set(type(error).__mro__) - set(getattr(builtins, type_name).__mro__) - {type(error)}
    assert added == {JobFailed, NNqueueError}
    assert str(error) == "it broke" and type(error).__name__ == type_name  # as the worker's error reads
    assert error.__notes__ == [f"job {JOB_ID} failed on the worker", "Intervention traceback:\n" + TRACEBACK.rstrip()]
    assert (error.type_name, error.error_message, error.traceback, error.job.id) == (
        type_name,
        "it broke",
        TRACEBACK,
        JOB_ID,
    )


def test_nnsights_and_vllms_error_types_are_theirs() -> None:
    from nnsight.intervention.interleaver import OutOfOrderError
    from vllm.exceptions import VLLMValidationError

    for kind in (OutOfOrderError, VLLMValidationError):
        with pytest.raises(kind) as caught:
            failed_job(kind.__name__).wait(progress=False)
        assert isinstance(caught.value, JobFailed) and not isinstance(caught.value, RuntimeError)
        assert str(caught.value) == "it broke"


@pytest.mark.parametrize(
    "type_name",
    ["InterventionStalled", "ExceptionGroup", "KeyboardInterrupt", "Exception", "os.system", "__class__", "Mediator"],
)
def test_names_the_client_cannot_raise_are_plain_job_failed(type_name: str) -> None:
    with pytest.raises(JobFailed) as caught:
        failed_job(type_name, TRACEBACK).wait(progress=False)
    assert type(caught.value) is JobFailed and caught.value.type_name == type_name
    assert str(caught.value) == f"{type_name}: it broke\n\nIntervention traceback:\n{TRACEBACK.rstrip()}"


@pytest.mark.parametrize("type_name", ["ValueError", "KeyError", "RuntimeError", "OutOfOrderError", "Stalled"])
def test_deferred_errors_read_as_nnsights_raise_deferred_for_a_local_vllm_run(type_name: str) -> None:
    from nnsight.intervention.errors import raise_deferred

    failure = JobFailed.from_job(failed_job(type_name, TRACEBACK), deferred=True)
    with pytest.raises(RuntimeError) as nnsight_way:
        raise_deferred({"type_name": type_name, "message": "it broke", "traceback": TRACEBACK})
    assert isinstance(failure, RuntimeError) and isinstance(failure, JobFailed)
    assert str(failure) == str(nnsight_way.value)
    if type_name != "Stalled":  # also the worker's class, where there is one
        assert type_name in {kind.__name__ for kind in type(failure).__mro__}


def test_vllms_own_errors_stay_themselves_when_deferred() -> None:
    from vllm.exceptions import VLLMValidationError

    failure = JobFailed.from_job(failed_job("VLLMValidationError"), deferred=True)
    assert isinstance(failure, VLLMValidationError) and not isinstance(failure, RuntimeError)
    assert str(failure) == "it broke"


def test_wait_follows_queued_running_completed_and_survives_a_blip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nnqueue.client.job.time.sleep", lambda seconds: None)
    answers = [
        httpx.Response(200, json=job_json("queued", queue_position=2)),
        httpx.Response(503, json={"detail": "database restarting"}),
        httpx.Response(200, json=job_json("running", progress={"done": 1, "total": 2})),
        httpx.Response(
            200, json=job_json("completed", progress={"done": 2, "total": 2}, result={"size": 3, "format": "torch"})
        ),
    ]
    client = scripted(lambda request: answers.pop(0))
    job = Job(client.transport, job_json())
    assert job.wait(progress=True) is job and job.info["status"] == "completed" and not answers


def test_a_cancelled_job_raises() -> None:
    client = scripted(lambda request: httpx.Response(200, json=job_json("cancelled")))
    with pytest.raises(JobCancelled, match="was cancelled"):
        client.job(JOB_ID).result(progress=False)


def test_results_follow_the_redirect_without_the_api_key_and_load_the_saves(tmp_path: Any) -> None:
    import torch

    data = saves_bytes({"logits": torch.arange(4.0), "tokens": [1, 2]})
    completed = job_json("completed", result={"size": len(data), "format": "torch"})
    presigned: list[httpx.Request] = []

    def api(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/result"):
            if request.url.params.get("inline") == "1":
                return httpx.Response(200, content=data, headers={"content-length": str(len(data))})
            return httpx.Response(302, headers={"location": "http://store.test/bucket/saves.pt?X-Amz-Signature=abc"})
        return httpx.Response(200, json=completed)

    def store(request: httpx.Request) -> httpx.Response:
        presigned.append(request)
        return httpx.Response(200, content=data)

    client = scripted(api)
    client.transport._plain = httpx.Client(transport=httpx.MockTransport(store))
    job = client.job(JOB_ID)

    saves = job.result(progress=False)
    assert torch.equal(saves["logits"], torch.arange(4.0)) and saves["tokens"] == [1, 2]
    [request] = presigned
    assert "authorization" not in request.headers and request.url.params["X-Amz-Signature"] == "abc"

    assert job.download(tmp_path / "r.pt", progress=False).read_bytes() == data
    assert job.download(tmp_path / "i.pt", progress=False, inline=True).read_bytes() == data
    assert len(presigned) == 2  # the inline download did not go to the store


def test_a_short_download_is_an_error_and_leaves_no_file(tmp_path: Any) -> None:
    completed = job_json("completed", result={"size": 100, "format": "torch"})

    def api(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/result"):
            return httpx.Response(200, content=b"only ten b")
        return httpx.Response(200, json=completed)

    with pytest.raises(IntegrityError, match="got 10 bytes, expected 100 bytes"):
        scripted(api).job(JOB_ID).download(tmp_path / "r.pt", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bytes_other_than_the_recorded_sha256_are_an_error_and_are_never_loaded(tmp_path: Any) -> None:
    import torch

    genuine, forged = saves_bytes({"x": torch.ones(2)}), saves_bytes({"x": torch.zeros(2)})
    assert len(genuine) == len(forged)
    recorded = {"size": len(genuine), "format": "torch", "sha256": hashlib.sha256(genuine).hexdigest()}

    def api(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/result"):
            return httpx.Response(200, content=forged)
        return httpx.Response(200, json=job_json("completed", result=recorded))

    job = scripted(api).job(JOB_ID)
    with pytest.raises(IntegrityError, match="does not match what the worker stored") as caught:
        job.result(progress=False)
    assert caught.value.expected == f"sha256 {recorded['sha256']}"
    with pytest.raises(IntegrityError):
        job.download(tmp_path / "r.pt", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_without_a_recorded_sha256_the_digest_header_is_checked() -> None:
    import torch

    genuine, forged = saves_bytes({"x": torch.ones(2)}), saves_bytes({"x": torch.zeros(2)})
    header = "sha-256=" + base64.b64encode(hashlib.sha256(genuine).digest()).decode()

    def api(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/result"):
            body = genuine if request.url.params.get("inline") else forged
            return httpx.Response(200, content=body, headers={"Digest": header})
        return httpx.Response(200, json=job_json("completed", result={"size": len(genuine), "format": "torch"}))

    job = scripted(api).job(JOB_ID)
    assert torch.equal(job.result(progress=False, inline=True)["x"], torch.ones(2))
    with pytest.raises(IntegrityError):
        job.result(progress=False)


def test_from_env_reads_url_key_and_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNQUEUE_URL", "http://queue.example:9000/")
    monkeypatch.setenv("NNQUEUE_API_KEY", "nnq_from_env")
    monkeypatch.setenv("NNQUEUE_BLOCKING", "0")
    client = Client.from_env()
    assert client.url == "http://queue.example:9000" and client.blocking is False
    assert client.transport._http.headers["authorization"] == "Bearer nnq_from_env"
    assert Client.from_env(url="http://other:1").url == "http://other:1"
    assert Client("http://x", None).blocking is False  # NNQUEUE_BLOCKING applies to direct construction too
    backend = client.backend(model_key="m", blocking=True, priority=5)
    assert backend.blocking is True and backend.submit_options == {"priority": 5}


def test_the_default_model_key_is_the_models_repo_id_or_path() -> None:
    from types import SimpleNamespace

    from nnqueue.client.backend import default_model_key

    class MetaVLLM:  # what nnsight's VLLM offers: no repo_id, the path it was built from
        def _remoteable_model_key(self) -> str:
            return "/models/smollm2-135m"

    assert default_model_key(SimpleNamespace(envoy=MetaVLLM())) == "/models/smollm2-135m"
    assert default_model_key(SimpleNamespace(envoy=SimpleNamespace(repo_id="HuggingFaceTB/SmolLM2-135M"))) == (
        "HuggingFaceTB/SmolLM2-135M"
    )
    with pytest.raises(ValueError, match=re.escape("pass client.backend")):
        default_model_key(SimpleNamespace(envoy=None))


def test_an_interrupted_blocking_trace_cancels_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    calls: list[str] = []

    def api(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        if request.url.path.endswith("/cancel"):
            return httpx.Response(200, json=job_json("cancelled"))
        return httpx.Response(201, json=job_json("queued"))

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("nnqueue.client.backend.build_payload", lambda tracer: b"trace")
    monkeypatch.setattr(Job, "result", interrupted)
    backend = scripted(api).backend(model_key="m")
    with pytest.raises(KeyboardInterrupt):
        backend(SimpleNamespace(info=None, envoy=object()))
    assert calls == ["POST /v1/jobs", f"POST /v1/jobs/{JOB_ID}/cancel"]


def test_harvest_export_without_the_training_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before it reads anything (the API here is unreachable), with a message and no traceback."""
    from typer.testing import CliRunner

    from nnqueue.cli import app

    env = {"NNQUEUE_URL": "http://127.0.0.1:9", "NNQUEUE_API_KEY": "nnq_x", "COLUMNS": "200"}
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: `import datasets` raises ImportError
    result = CliRunner().invoke(app, ["harvest", "export", "some-id", "out", "--format", "hf"], env=env)
    assert result.exit_code == 1, result.output
    assert "pip install 'nnqueue[train]'" in result.output and "Traceback" not in result.output
    monkeypatch.delitem(sys.modules, "datasets")
    refused = CliRunner().invoke(app, ["harvest", "export", "x", "out", "--drop-norm-above", "ten"], env=env)
    assert refused.exit_code == 1 and "a multiple of the median norm (10x), not 'ten'" in refused.output
    both = CliRunner().invoke(
        app, ["harvest", "export", "x", "out", "--drop-norm-above", "9", "--clip-norm-above", "9"], env=env
    )
    assert both.exit_code == 2 and "not both" in both.output
