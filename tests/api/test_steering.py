"""The steering API on real Postgres, Redis and S3, with a worker row that published capture points (no engine
runs here: tests/workers/test_steering_worker.py runs a job end to end). A harvest-scope key submits; bad specs get
4xx with reasons checked against the published points; vectors come from an uploaded safetensors file or from
a completed harvest's manifest statistics (a mean difference); the frozen payload holds what was asked."""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from nnqueue.broker import queue_name, ready_messages
from nnqueue.db.models import Harvest, Job, JobKind, JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler.payloads import load_payload
from nnqueue.scheduler.steering import decode_payload
from tests.utils.api import Api, register_worker
from tests.utils.services import Services

MODEL = "steer-model"
WIDTH = 8
POINTS = [
    {"module": "model.layers.0", "io": "output", "parts": ["residual_stream", "hidden", "residual"], "width": WIDTH},
    {"module": "model.layers.1", "io": "output", "parts": ["residual_stream", "hidden", "residual"], "width": WIDTH},
    {"module": "model.layers.1.mlp", "io": "output", "parts": [], "width": None},
]


@pytest.fixture(scope="module", autouse=True)
def steer_worker(services: Services) -> None:
    register_worker(services.sessions, MODEL, capture_points=POINTS)
    register_worker(services.sessions, "no-steering-model", capture_points=[])


def spec(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model_key": MODEL,
        "dataset": {"prompts": ["one", "two"]},
        "sampling": {"max_tokens": 4},
        "edits": [{"module": "model.layers.1", "op": "add", "coefficient": 2.0, "vector": "v"}],
    }
    body.update(overrides)
    return body


def vectors(**arrays: Any) -> bytes:
    return save({name: np.asarray(a, np.float32) for name, a in arrays.items()})


def submit(api: Api, headers: dict[str, str], body: dict[str, Any], files: dict[str, bytes] | None = None) -> Any:
    upload = {name: (f"{name}.bin", data) for name, data in (files or {}).items()}
    return api.http.post("/v1/steering", headers=headers, data={"spec": json.dumps(body)}, files=upload or None)


def payload_of(services: Services, job_id: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with services.sessions() as session:
        job = session.get(Job, uuid.UUID(job_id))
        assert job is not None and job.kind is JobKind.STEER
        body, vecs = decode_payload(load_payload(services.sessions, services.store, job))
    return body, {name: np.frombuffer(data, np.float32) for name, data in vecs.items()}


def test_a_harvest_key_submits_and_follows_a_steering_job(api: Api, services: Services) -> None:
    alice = api.new_key("alice", ("harvest",))
    tokens_before = ready_messages(services.celery, queue_name(MODEL))
    vector = np.arange(WIDTH, dtype=np.float32)
    response = submit(api, alice, spec(), {"vectors": vectors(v=vector)})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["kind"] == "steer" and job["status"] == "queued" and job["queue_position"] == 1
    assert ready_messages(services.celery, queue_name(MODEL)) == tokens_before + 1
    body, vecs = payload_of(services, job["id"])
    assert body["prompts"] == ["one", "two"] and body["sampling"]["max_tokens"] == 4
    assert body["sampling"]["temperature"] == 0.0  # greedy by default
    assert body["edits"] == [
        {
            "module": "model.layers.1",
            "io": "output",
            "part": None,
            "op": "add",
            "coefficient": 2.0,
            "vector": "v",
            "apply_to": "both",
        }
    ]
    np.testing.assert_array_equal(vecs["v"], vector)

    assert api.http.get(f"/v1/steering/{job['id']}", headers=alice).json()["id"] == job["id"]
    assert [j["id"] for j in api.http.get("/v1/steering", headers=alice).json()["jobs"]] == [job["id"]]
    assert api.http.get(f"/v1/steering/{job['id']}/result", headers=alice).status_code == 409
    bob = api.new_key("bob", ("harvest",))
    assert api.http.get(f"/v1/steering/{job['id']}", headers=bob).status_code == 404
    cancelled = api.http.post(f"/v1/steering/{job['id']}/cancel", headers=alice)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert api.http.post(f"/v1/steering/{job['id']}/cancel", headers=alice).status_code == 409
    # A trace job is not a steering job.
    trace = api.submit_ok(api.new_key("alice"), model_key=MODEL)
    assert api.http.get(f"/v1/steering/{trace['id']}", headers=alice).status_code == 404


def test_a_key_without_the_harvest_scope_is_refused(api: Api) -> None:
    tracer = api.new_key("carol", ("trace",))
    response = submit(api, tracer, spec(), {"vectors": vectors(v=np.ones(WIDTH))})
    assert response.status_code == 403 and "'harvest' scope" in response.json()["detail"]


@pytest.mark.parametrize(
    ("body", "files", "status", "reason"),
    [
        (spec(edits=[{"module": "model.layers.9", "op": "zero"}]), {}, 422, "model.layers.1"),
        (spec(edits=[{"module": "model.layers.1", "op": "zero", "part": "hidden", "io": "input"}]), {}, 422, "not"),
        (spec(), {"vectors": vectors(v=np.ones(WIDTH + 1))}, 422, "has 9 values; model.layers.1.output has 8"),
        (spec(), {"vectors": vectors(w=np.ones(WIDTH))}, 422, "names vector 'v'; the vectors file has ['w']"),
        (spec(), {}, 422, "names vector 'v'"),
        (spec(), {"vectors": b"not safetensors"}, 422, "not a safetensors file"),
        (spec(), {"vectors": vectors(v=np.ones((2, WIDTH)))}, 422, "1-D float"),
        (spec(), {"vectors": vectors(v=np.full(WIDTH, np.nan))}, 422, "NaN"),
        (
            spec(edits=[{"module": "model.layers.1.mlp", "op": "add", "vector": "v"}]),
            {"vectors": vectors(v=np.ones(WIDTH))},
            422,
            "does not publish its width",
        ),
        (spec(edits=[{"module": "model.layers.1", "op": "add"}]), {}, 422, "needs a vector"),
        (spec(edits=[{"module": "model.layers.1", "op": "zero", "vector": "v"}]), {}, 422, "takes no vector"),
        (spec(edits=[{"module": "model.layers.1", "op": "shift"}]), {}, 422, "op"),
        (spec(edits=[{"module": "model.layers.1", "op": "zero"}] * 2), {}, 422, "one edit per module point"),
        (spec(edits=[]), {}, 422, "edits"),
        (spec(model_key="nobody-serves-this"), {}, 400, "no live worker"),
        (spec(model_key="no-steering-model"), {}, 400, "run no steering"),
        (spec(dataset={}, edits=[{"module": "model.layers.1", "op": "zero"}]), {}, 422, "no source"),
        (spec(sampling={"temperature": -1}), {}, 422, "temperature"),
        (
            spec(edits=[{"module": "model.layers.1", "op": "zero"}], captures=[{"module": "model.layers.7"}]),
            {},
            422,
            "not capturable on this model: ['model.layers.7.output']",
        ),
        (
            spec(edits=[{"module": "model.layers.1", "op": "zero"}], captures=[{"module": "model.layers.1"}] * 2),
            {},
            422,
            "more than once",
        ),
        (spec(edits=[{"module": "model.layers.1", "op": "zero"}], selection={"kind": "last"}), {}, 422, "captures"),
        (
            spec(
                edits=[{"module": "model.layers.1", "op": "zero"}], captures=[{"module": "model.layers.1"}], dtype="i8"
            ),
            {},
            422,
            "dtype",
        ),
    ],
)
def test_refusals_at_submit(api: Api, body: dict[str, Any], files: dict[str, bytes], status: int, reason: str) -> None:
    dave = api.new_key("dave", ("harvest",))
    response = submit(api, dave, body, files)
    assert response.status_code == status, response.text
    assert reason in json.dumps(response.json()["detail"])


def test_captures_are_frozen_with_the_job(api: Api, services: Services) -> None:
    """Captures are checked against the published points as a harvest's are, and frozen into the payload with the
    selection and dtype; a spec without them freezes none (the job steers only)."""
    fay = api.new_key("fay", ("harvest",))
    edits = [{"module": "model.layers.1", "op": "zero"}]
    captures = [{"module": "model.layers.0"}, {"module": "model.layers.1", "part": "hidden"}]
    selection = {"kind": "last", "n": 2, "tokens": "generated"}
    response = submit(api, fay, spec(edits=edits, captures=captures, selection=selection, dtype="bfloat16"))
    assert response.status_code == 201, response.text
    body, _ = payload_of(services, response.json()["id"])
    assert body["capture"] == {
        "captures": [
            {"module": "model.layers.0", "io": "output", "part": None},
            {"module": "model.layers.1", "io": "output", "part": "hidden"},
        ],
        "selection": {"kind": "last", "n": 2, "positions": [], "skip": 0, "tokens": "generated"},
        "dtype": "bfloat16",
    }
    plain = submit(api, fay, spec(edits=edits))
    assert plain.status_code == 201, plain.text
    assert payload_of(services, plain.json()["id"])[0]["capture"] is None


def completed_harvest(services: Services, owner: str, means: dict[str, list[float]], done: bool = True) -> str:
    harvest_id = uuid.uuid4()
    manifest_key = f"harvests/{harvest_id}/manifest.json"
    services.store.put_bytes(
        manifest_key, json.dumps({"statistics": {k: {"mean": v} for k, v in means.items()}}).encode()
    )
    with transaction(services.sessions) as session:
        session.add(
            Harvest(
                id=harvest_id,
                owner=owner,
                model_key=MODEL,
                status=JobStatus.COMPLETED if done else JobStatus.RUNNING,
                spec={},
                dataset_key="d",
                dataset_digest="0" * 64,
                prompts=1,
                chunks_total=1,
                manifest_key=manifest_key if done else None,
            )
        )
    return str(harvest_id)


def test_vectors_from_harvest_statistics(api: Api, services: Services) -> None:
    erin = api.new_key("erin", ("harvest",))
    point = "model.layers.1.output"
    happy = completed_harvest(services, "erin", {point: [float(i) for i in range(WIDTH)]})
    sad = completed_harvest(services, "erin", {point: [1.0] * WIDTH})
    ref = {"harvest": happy, "capture": point, "stat": "mean", "minus": {"harvest": sad, "capture": point}}
    edits = [
        {"module": "model.layers.1", "op": "add", "coefficient": 3.0, "vector": ref},
        {"module": "model.layers.0", "op": "project_out", "vector": {"harvest": sad, "capture": point}},
    ]
    response = submit(api, erin, spec(edits=edits))
    assert response.status_code == 201, response.text
    body, vecs = payload_of(services, response.json()["id"])
    assert [e["vector"] for e in body["edits"]] == ["harvest.0", "harvest.1"]
    np.testing.assert_array_equal(vecs["harvest.0"], np.arange(WIDTH, dtype=np.float32) - 1.0)
    np.testing.assert_array_equal(vecs["harvest.1"], np.ones(WIDTH, np.float32))

    frank_harvest = completed_harvest(services, "frank", {point: [0.0] * WIDTH})
    running = completed_harvest(services, "erin", {point: [0.0] * WIDTH}, done=False)
    for harvest, capture, status, reason in (
        (frank_harvest, point, 404, "no harvest"),
        (running, point, 409, "running"),
        (happy, "model.layers.0.output", 422, "captured no"),
    ):
        bad = [{"module": "model.layers.1", "op": "add", "vector": {"harvest": harvest, "capture": capture}}]
        response = submit(api, erin, spec(edits=bad))
        assert response.status_code == status, response.text
        assert reason in response.json()["detail"]
