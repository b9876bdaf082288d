"""``/v1/jobs`` without a worker process: submission and its limits, tenant isolation, listing, cancelling.

Jobs are submitted for a model whose worker row is live, so they stay QUEUED (no process consumes
their queue); completed jobs are made through the same lifecycle calls a worker makes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from nnqueue import trace_payload
from nnqueue.api.limits import FORM_OVERHEAD_BYTES
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import Job, JobEvent, JobStatus, utcnow
from nnqueue.db.session import transaction
from nnqueue.scheduler.payloads import load_payload
from nnqueue.scheduler.retention import purge_expired
from nnqueue.storage.results import load_result
from tests.utils.api import LIVE_MODEL, Api, api_client, complete, register_worker
from tests.utils.payloads import fake_trace
from tests.utils.results import store_result
from tests.utils.servers import free_ports
from tests.utils.services import Services

S = JobStatus


@pytest.fixture(scope="module", autouse=True)
def live_worker(services: Services) -> str:
    return register_worker(services.sessions)


def test_submit_stores_the_job_and_returns_it(api: Api, services: Services) -> None:
    alice = api.new_key("alice")
    client = {"nnsight": "0.8.1", "python": "3.11.9"}
    job = api.submit_ok(alice, fake_trace(b"serialized trace"), priority=3, metadata={"run": 7}, client=client)

    assert job["owner"] == "alice" and job["model_key"] == LIVE_MODEL and job["kind"] == "trace"
    assert job["status"] == "queued" and job["priority"] == 3 and job["metadata"] == {"run": 7}
    assert job["timeout_s"] == api.resources.settings.default_job_timeout_s  # null -> the server's default
    assert job["attempts"] == 0 and job["progress"] == {"done": 0, "total": None}
    assert job["error"] is None and job["result"] is None and job["started_at"] is None
    assert job["created_at"].endswith("Z") and job["queue_position"] >= 1

    stored = services.job(uuid.UUID(job["id"]))
    assert stored.meta == {"metadata": {"run": 7}, "client": client}  # the worker reads meta["client"]
    assert stored.payload_key is None  # small: kept in the database, no object-store round trip
    assert load_payload(services.sessions, services.store, stored) == fake_trace(b"serialized trace")
    assert api.http.get(f"/v1/jobs/{job['id']}", headers=alice).json() == job


def test_a_raw_payload_with_its_spec_in_a_header_is_a_job_like_a_forms(api: Api, services: Services) -> None:
    alice = api.new_key("alice")
    spec = {"priority": 2, "timeout_s": 30, "metadata": {"run": "é ✓"}, "client": {"nnsight": "0.8.1", "python": "3"}}
    raw = api.submit_raw(alice, fake_trace(b"raw body"), **spec)
    assert raw.status_code == 201, raw.text
    form = api.submit_ok(alice, fake_trace(b"raw body"), **spec)
    differ = {"id", "created_at", "queued_at", "queue_position"}
    assert {k: v for k, v in raw.json().items() if k not in differ} == {
        k: v for k, v in form.items() if k not in differ
    }
    stored = services.job(uuid.UUID(raw.json()["id"]))
    assert stored.meta == {"metadata": {"run": "é ✓"}, "client": spec["client"]}
    assert load_payload(services.sessions, services.store, stored) == fake_trace(b"raw body")


@pytest.mark.parametrize(
    ("spec_header", "payload", "loc", "says"),
    [
        (None, fake_trace(), ["header", "nnqueue-spec"], "Field required"),
        ('{"model_key": "é"}'.encode(), fake_trace(), ["header", "nnqueue-spec"], "must be ASCII"),
        ("{not json", fake_trace(), ["header", "nnqueue-spec"], "not JSON"),
        (json.dumps({"kind": "trace"}), fake_trace(), ["header", "nnqueue-spec", "model_key"], "Field required"),
        (
            json.dumps({"model_key": LIVE_MODEL, "timeout_s": 0}),
            fake_trace(),
            ["header", "nnqueue-spec", "timeout_s"],
            "greater than 0",
        ),
        ('{"model_key": "m", "metadata": {"x": NaN}}', fake_trace(), ["header", "nnqueue-spec"], "NaN is not JSON"),
        (json.dumps({"model_key": LIVE_MODEL}), b"not a trace", ["body", "payload"], "neither an nnqueue prebuilt"),
    ],
)
def test_a_raw_submission_that_is_wrong_is_422_naming_where(
    api: Api, spec_header: str | bytes | None, payload: bytes, loc: list[str], says: str
) -> None:
    headers = api.new_key(f"raw-{uuid.uuid4().hex[:8]}")
    if spec_header is None:
        response = api.http.post(
            "/v1/jobs", headers={**headers, "Content-Type": "application/octet-stream"}, content=payload
        )
    else:
        response = api.submit_raw(headers, payload, spec_header=spec_header)
    assert response.status_code == 422, response.text
    [error] = [error for error in response.json()["detail"] if error["loc"] == loc]
    assert says in error["msg"]
    assert api.http.get("/v1/jobs", headers=headers).json()["jobs"] == []


def test_a_payload_over_the_inline_limit_goes_to_the_object_store(services: Services) -> None:
    large, small = fake_trace(b"a larger body"), fake_trace(b"small")
    with api_client(services, inline_payload_max_bytes=len(small), worker_stale_after_s=3600) as api:
        alice = api.new_key("alice")
        job = services.job(uuid.UUID(api.submit_ok(alice, large)["id"]))
        assert job.payload_key is not None and api.resources.store.get_bytes(job.payload_key) == large
        assert load_payload(services.sessions, services.store, job) == large
        inline = services.job(uuid.UUID(api.submit_ok(alice, small)["id"]))
        assert inline.payload_key is None and load_payload(services.sessions, services.store, inline) == small


def test_queue_position_counts_the_models_queued_jobs_in_order(api: Api, services: Services) -> None:
    model = "position-model"
    register_worker(services.sessions, model)
    alice, bob = api.new_key("alice"), api.new_key("bob")
    ids = [api.submit_ok(key, model_key=model)["id"] for key in (alice, bob, alice)]

    def position(job_id: str, key: dict[str, str]) -> int | None:
        return api.http.get(f"/v1/jobs/{job_id}", headers=key).json()["queue_position"]

    assert [position(ids[0], alice), position(ids[1], bob), position(ids[2], alice)] == [1, 2, 3]
    api.http.post(f"/v1/jobs/{ids[0]}/cancel", headers=alice)
    assert [position(ids[0], alice), position(ids[1], bob), position(ids[2], alice)] == [None, 1, 2]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ("{not json", ["body", "spec"]),
        (json.dumps({"kind": "trace"}), ["body", "spec", "model_key"]),
        (json.dumps({"model_key": LIVE_MODEL, "kind": "harvest-everything"}), ["body", "spec", "kind"]),
        (json.dumps({"model_key": LIVE_MODEL, "timeout_s": 0}), ["body", "spec", "timeout_s"]),
        (json.dumps({"model_key": LIVE_MODEL, "timeout_s": 86401}), ["body", "spec", "timeout_s"]),
        (json.dumps({"model_key": LIVE_MODEL, "timeout_s": "soon"}), ["body", "spec", "timeout_s"]),
        (json.dumps({"model_key": LIVE_MODEL, "priority": 1.5}), ["body", "spec", "priority"]),
        (json.dumps({"model_key": LIVE_MODEL, "client": {"nnsight": "0.8"}}), ["body", "spec", "client", "python"]),
        (json.dumps({"model_key": LIVE_MODEL, "timeout": 5}), ["body", "spec", "timeout"]),
        (json.dumps(["model_key"]), ["body", "spec"]),
    ],
)
def test_a_malformed_spec_is_422_naming_the_field(api: Api, spec: str, field: list[str]) -> None:
    response = api.http.post(
        "/v1/jobs", headers=api.new_key("alice"), data={"spec": spec}, files={"payload": ("t", b"x")}
    )
    assert response.status_code == 422, response.text
    assert field in [error["loc"] for error in response.json()["detail"]]


def test_missing_form_fields_are_422(api: Api) -> None:
    alice = api.new_key("alice")
    no_payload = api.http.post("/v1/jobs", headers=alice, data={"spec": json.dumps({"model_key": LIVE_MODEL})})
    no_spec = api.http.post("/v1/jobs", headers=alice, files={"payload": ("t", b"x")})
    assert no_payload.status_code == no_spec.status_code == 422
    assert ["body", "payload"] in [error["loc"] for error in no_payload.json()["detail"]]
    assert ["body", "spec"] in [error["loc"] for error in no_spec.json()["detail"]]
    as_json = api.http.post("/v1/jobs", headers=alice, json={"spec": {"model_key": LIVE_MODEL}, "payload": "x"})
    assert as_json.status_code == 422  # neither a form nor a raw payload: both form fields are missing
    assert {("body", "spec"), ("body", "payload")} <= {tuple(error["loc"]) for error in as_json.json()["detail"]}


def test_form_fields_of_the_wrong_kind_are_422(api: Api) -> None:
    alice, spec = api.new_key("alice"), json.dumps({"model_key": LIVE_MODEL})
    spec_as_file = api.http.post("/v1/jobs", headers=alice, files={"spec": ("s", spec), "payload": ("t", fake_trace())})
    payload_as_text = api.http.post("/v1/jobs", headers=alice, data={"spec": spec, "payload": "text"})
    assert spec_as_file.status_code == payload_as_text.status_code == 422
    assert [error["loc"] for error in spec_as_file.json()["detail"]] == [["body", "spec"]]
    assert [error["loc"] for error in payload_as_text.json()["detail"]] == [["body", "payload"]]
    not_a_form = {**alice, "Content-Type": "multipart/form-data; boundary=b"}
    broken = api.http.post("/v1/jobs", headers=not_a_form, content=b"--b\r\nno headers, no end")
    assert broken.status_code == 400, broken.text


def test_an_oversized_payload_is_413_and_nothing_is_stored(services: Services) -> None:
    limit = 1000
    with api_client(services, max_payload_bytes=limit, worker_stale_after_s=3600) as api:
        ivan = api.new_key("ivan")
        assert api.submit(ivan, fake_trace(b"x" * (limit - 11))).status_code == 201  # exactly the limit is fine

        assert api.submit_raw(ivan, fake_trace(b"x" * (limit - 11))).status_code == 201

        over = api.submit(ivan, b"x" * (limit + 1))  # checked by the route
        huge = api.submit(ivan, b"x" * (4 * 1024 * 1024))  # refused from its Content-Length
        raw_over, raw_huge = api.submit_raw(ivan, b"x" * (limit + 1)), api.submit_raw(ivan, b"x" * (4 * 1024 * 1024))
        for response in (over, huge, raw_over, raw_huge):
            assert response.status_code == 413, response.text
            detail = response.json()["detail"]
            assert detail == f"payload too large: the limit is {limit} bytes (NNQUEUE_MAX_PAYLOAD_BYTES)"
        assert len(api.http.get("/v1/jobs", headers=ivan).json()["jobs"]) == 2


def _post_chunks(api: Api, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, int]:
    """POST /v1/jobs driven at the ASGI level, chunk by chunk as a server delivers a chunked upload, then a
    disconnect; the response's status and the bytes the app read."""
    messages, received, response = iter(chunks), 0, {}

    async def receive() -> dict[str, Any]:
        nonlocal received
        body = next(messages, None)
        if body is None:
            return {"type": "http.disconnect"}
        received += len(body)
        return {"type": "http.request", "body": body, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            response["status"] = message["status"]

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/jobs",
        "raw_path": b"/v1/jobs",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", api.new_key("ivan")["Authorization"].encode()), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    asyncio.run(api.http.app(scope, receive, send))
    return response["status"], received


SPEC = json.dumps({"model_key": LIVE_MODEL}).encode()
FORM_HEAD = b'--b\r\nContent-Disposition: form-data; name="spec"\r\n\r\n' + SPEC + b"\r\n"
FORM_HEAD += b'--b\r\nContent-Disposition: form-data; name="payload"; filename="t"\r\n\r\n'
FORM = [(b"content-type", b"multipart/form-data; boundary=b")]
RAW = [(b"content-type", b"application/octet-stream"), (b"nnqueue-spec", SPEC)]


@pytest.mark.parametrize(("headers", "head"), [(FORM, FORM_HEAD), (RAW, b"")], ids=["form", "raw"])
def test_an_upload_without_content_length_is_cut_off_while_it_streams_in(
    services: Services, headers: list[tuple[bytes, bytes]], head: bytes
) -> None:
    limit, chunk = 1000, b"x" * 65536
    with api_client(services, max_payload_bytes=limit, worker_stale_after_s=3600) as api:
        status_code, received = _post_chunks(api, headers, [head] + [chunk] * 1024)  # a 64 MiB upload
    assert status_code == 413
    assert received <= limit + FORM_OVERHEAD_BYTES + len(chunk)  # it stopped reading near the limit


@pytest.mark.parametrize(("headers", "head"), [(FORM, FORM_HEAD), (RAW, b"")], ids=["form", "raw"])
def test_a_client_that_leaves_mid_upload_gets_a_400_and_nothing_is_stored(
    api: Api, headers: list[tuple[bytes, bytes]], head: bytes
) -> None:
    before = len(api.http.get("/v1/jobs?limit=200", headers=api.new_key("ivan")).json()["jobs"])
    status_code, _ = _post_chunks(api, headers, [head, fake_trace(b"half a pay")])
    assert status_code == 400
    assert len(api.http.get("/v1/jobs?limit=200", headers=api.new_key("ivan")).json()["jobs"]) == before


def test_jobs_in_flight_per_key_and_per_owner_are_limited_with_429(services: Services) -> None:
    limits = {"max_jobs_in_flight_per_key": 2, "max_jobs_in_flight_per_owner": 3}
    with api_client(services, **limits, worker_stale_after_s=3600) as api:
        first_key, second_key = api.new_key("erin"), api.new_key("erin")
        ids = [api.submit_ok(first_key)["id"] for _ in range(2)]

        refused = api.submit(first_key)
        assert refused.status_code == 429 and "already has 2 jobs queued or running" in refused.json()["detail"]
        assert api.submit(second_key).status_code == 201  # the second key has room, and so has the owner (3)

        # The owner's limit counts all its keys: the second key's next job would be the owner's fourth.
        refused = api.submit(second_key)
        assert refused.status_code == 429, refused.text
        assert "owner already has 3 jobs queued or running through its keys; the limit is 3" in refused.json()["detail"]
        assert "NNQUEUE_MAX_JOBS_IN_FLIGHT_PER_OWNER" in refused.json()["detail"]
        assert api.submit(api.new_key("fay")).status_code == 201  # another owner's are not counted

        api.http.post(f"/v1/jobs/{ids[0]}/cancel", headers=first_key)  # an ended job frees its place
        assert api.submit(second_key).status_code == 201


def test_an_unknown_model_is_400_naming_the_live_models(api: Api) -> None:
    response = api.submit(api.new_key("alice"), model_key="gpt-nobody")
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert "'gpt-nobody'" in detail and f"'{LIVE_MODEL}'" in detail


def test_a_broker_that_is_down_is_503_and_the_job_is_marked_failed(services: Services) -> None:
    [closed_port] = free_ports(1)
    with api_client(services, broker_url=f"redis://127.0.0.1:{closed_port}/0", worker_stale_after_s=3600) as api:
        alice = api.new_key("frank")
        response = api.submit(alice)
        assert response.status_code == 503 and "broker is unreachable" in response.json()["detail"]
        [job] = api.http.get("/v1/jobs", headers=alice).json()["jobs"]
    assert job["status"] == "failed" and "could not be put on the queue" in job["error"]["message"]


def test_another_owners_job_is_404_everywhere(api: Api, services: Services) -> None:
    import torch

    alice, bob = api.new_key("alice"), api.new_key("bob")
    queued = api.submit_ok(bob)["id"]
    completed = api.submit_ok(bob)["id"]
    complete(services, completed, {"x": torch.ones(2)})

    for job_id in (queued, completed):
        assert api.http.get(f"/v1/jobs/{job_id}", headers=bob).status_code == 200
        for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/result"), ("GET", "/result?inline=1")):
            response = api.http.request(method, f"/v1/jobs/{job_id}{path}", headers=alice)
            assert response.status_code == 404, (method, path)
            assert response.json()["detail"] == f"no job {job_id}"
        assert api.http.get(f"/ndif/response/{job_id}", headers=alice).json()["detail"] == f"no job {job_id}"
    listed = {job["id"] for job in api.http.get("/v1/jobs?limit=200", headers=alice).json()["jobs"]}
    assert queued not in listed and completed not in listed
    assert services.job(uuid.UUID(queued)).status is S.QUEUED  # alice's cancel did nothing
    assert api.http.get(f"/v1/jobs/{completed}/result?inline=1", headers=bob).status_code == 200
    assert api.http.get(f"/v1/jobs/{uuid.uuid4()}", headers=bob).status_code == 404
    assert api.http.get("/v1/jobs/not-a-uuid", headers=bob).status_code == 422


def test_listing_pages_through_the_callers_jobs_newest_first_without_gaps(api: Api) -> None:
    gina, bob = api.new_key("gina"), api.new_key("bob")
    mine = [api.submit_ok(gina, metadata={"n": n})["id"] for n in range(7)]
    api.submit_ok(bob)

    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = api.http.get("/v1/jobs", headers=gina, params=params).json()
        seen += [job["id"] for job in page["jobs"]]
        pages += 1
        api.submit_ok(gina)  # newer jobs arriving meanwhile do not shift the pages
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3 and seen == mine[::-1]

    everything = api.http.get("/v1/jobs", headers=gina, params={"limit": 200}).json()
    assert len(everything["jobs"]) == 10 and everything["next_cursor"] is None
    assert api.http.get("/v1/jobs", headers=gina, params={"cursor": "bogus"}).status_code == 422
    assert api.http.get("/v1/jobs", headers=gina, params={"limit": 0}).status_code == 422
    assert api.http.get("/v1/jobs", headers=gina, params={"limit": 201}).status_code == 422


def test_listing_filters_by_status_and_model(api: Api, services: Services) -> None:
    register_worker(services.sessions, "filter-model")
    hank = api.new_key("hank")
    queued = api.submit_ok(hank)["id"]
    other_model = api.submit_ok(hank, model_key="filter-model")["id"]
    cancelled = api.submit_ok(hank)["id"]
    api.http.post(f"/v1/jobs/{cancelled}/cancel", headers=hank)

    def ids(**params: str) -> list[str]:
        return [job["id"] for job in api.http.get("/v1/jobs", headers=hank, params=params).json()["jobs"]]

    assert ids(status="cancelled") == [cancelled]
    assert ids(status="queued") == [other_model, queued]
    assert ids(model_key="filter-model") == [other_model]
    assert ids(status="queued", model_key=LIVE_MODEL) == [queued]
    assert api.http.get("/v1/jobs", headers=hank, params={"status": "lost"}).status_code == 422


def test_cancel_a_queued_job_and_409_once_it_has_ended(api: Api, services: Services) -> None:
    import torch

    alice = api.new_key("alice")
    job_id = api.submit_ok(alice)["id"]

    cancelled = api.http.post(f"/v1/jobs/{job_id}/cancel", headers=alice)
    assert cancelled.status_code == 200
    body = cancelled.json()
    assert body["status"] == "cancelled" and body["finished_at"] is not None and body["queue_position"] is None
    with services.sessions() as session:
        events = select(JobEvent).where(JobEvent.job_id == uuid.UUID(job_id)).order_by(JobEvent.id.desc())
        event = session.scalar(events)
    assert event.to_status is S.CANCELLED and event.detail == {"by": "alice"}

    again = api.http.post(f"/v1/jobs/{job_id}/cancel", headers=alice)
    assert again.status_code == 409 and "is cancelled" in again.json()["detail"]

    finished = api.submit_ok(alice)["id"]
    complete(services, finished, {"x": torch.ones(1)})
    refused = api.http.post(f"/v1/jobs/{finished}/cancel", headers=alice)
    assert refused.status_code == 409 and "is completed" in refused.json()["detail"]
    with services.sessions() as session:
        assert session.get(Job, uuid.UUID(finished)).status is S.COMPLETED


def test_a_result_is_409_until_the_job_completes(api: Api, services: Services) -> None:
    import torch

    alice = api.new_key("alice")
    job_id = api.submit_ok(alice, safetensors=True)["id"]
    early = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice)
    assert early.status_code == 409 and "is queued" in early.json()["detail"]

    complete(services, job_id, {"tensor": torch.ones(1), "count": 3})  # not all tensors: no safetensors copy
    body = api.http.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert body["status"] == "completed" and body["result"]["format"] == "torch" and body["result"]["size"] > 0
    no_safetensors = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice, params={"format": "safetensors"})
    assert no_safetensors.status_code == 409 and "not every saved value is a tensor" in no_safetensors.json()["detail"]
    assert api.http.get(f"/v1/jobs/{job_id}/result", headers=alice, params={"format": "npz"}).status_code == 422


def test_a_copy_recorded_before_its_size_was_is_still_served(api: Api, services: Services) -> None:
    """A job finished before migration 0009 has the copy in its format only (no size, no sha256)."""
    import torch

    alice = api.new_key("alice")
    job_id = api.submit_ok(alice, safetensors=True)["id"]
    complete(services, job_id, {"h": torch.ones(2)}, result_safetensors_size=None, result_safetensors_sha256=None)
    copy = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice, params={"format": "safetensors", "inline": 1})
    assert copy.status_code == 200 and copy.content == services.store.get_bytes(f"results/{job_id}/1/saves.safetensors")


def test_a_purged_jobs_result_is_410_and_the_job_says_when(api: Api, services: Services) -> None:
    import torch

    alice = api.new_key("alice")
    job_id = api.submit_ok(alice)["id"]
    complete(services, job_id, {"x": torch.ones(1)})
    with transaction(services.sessions) as session:
        ended = utcnow() - timedelta(days=3)
        session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(finished_at=ended))
    assert api.http.get(f"/v1/jobs/{job_id}", headers=alice).json()["purged_at"] is None

    purge_expired(services.sessions, services.store, timedelta(days=2))
    body = api.http.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert body["status"] == "completed" and body["purged_at"] is not None and body["result"]["size"] > 0
    for params in ({}, {"inline": 1}, {"format": "safetensors"}):
        gone = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice, params=params)
        assert gone.status_code == 410 and "was deleted at" in gone.json()["detail"], params


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"random bytes, not a trace", "neither an nnqueue prebuilt trace nor an nnsight serialized trace"),
        (b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + b"short", "neither an nnqueue prebuilt trace"),
        (trace_payload.MAGIC + (1 << 20).to_bytes(8, "big") + b"{}", "invalid prebuilt trace: header length"),
        (trace_payload.MAGIC + (7).to_bytes(8, "big") + b"{nope}}", "invalid prebuilt trace: header is not JSON"),
        (trace_payload.MAGIC + (13).to_bytes(8, "big") + b'{"format": 9}', "prebuilt trace format 9 is not supported"),
    ],
    ids=["random", "truncated-pickle", "header-past-end", "header-not-json", "future-format"],
)
def test_a_payload_that_is_no_trace_is_422_and_nothing_is_stored(api: Api, payload: bytes, reason: str) -> None:
    vera = api.new_key("vera")
    response = api.submit(vera, payload)
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "payload"] and reason in error["msg"]
    assert api.http.get("/v1/jobs", headers=vera).json()["jobs"] == []


def test_a_zstd_compressed_nnsight_trace_is_accepted(api: Api) -> None:
    assert api.submit(api.new_key("alice"), trace_payload.ZSTD_MAGIC + b"compressed frame").status_code == 201


def test_a_failed_trace_that_saved_values_serves_them(api: Api, services: Services) -> None:
    import torch

    alice = api.new_key("alice")
    job_id = api.submit_ok(alice)["id"]
    job_uuid = uuid.UUID(job_id)
    with transaction(services.sessions) as session:
        transition(session, job_uuid, S.RUNNING, worker_id="test-worker")
    stored = store_result(services.store, job_uuid, {"first_invoke": torch.ones(2)})
    with transaction(services.sessions) as session:
        transition(
            session,
            job_uuid,
            S.FAILED,
            error_type="TypeError",
            error_message="the second invoke failed",
            result_key=stored.key,
            result_size=stored.size,
            result_format=stored.format,
        )
    body = api.http.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert body["status"] == "failed" and body["error"]["type"] == "TypeError" and body["result"]["size"] == stored.size
    served = api.http.get(f"/v1/jobs/{job_id}/result", headers=alice, params={"inline": 1})
    assert served.status_code == 200 and set(load_result(served.content)) == {"first_invoke"}
