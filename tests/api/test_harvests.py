"""The harvest and schedule API on real Postgres, Redis and S3, with worker rows that published capture points
(no engine runs here: tests/workers/test_harvest.py runs harvests end to end). Bad specs get 4xx with
reasons; a good one freezes its dataset and queues one chunk token per chunk; owners see only their own, an
admin key everyone's; every route needs the harvest scope."""

from __future__ import annotations

import io
import json
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from nnqueue.broker import bulk_queue_name, ready_messages
from nnqueue.db.models import Harvest, HarvestChunk, HarvestSchedule, JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler.beat import run_beat
from nnqueue.scheduler.harvest_dataset import Limits, read_slice
from nnqueue.scheduler.schedules import fire_due
from tests.utils.api import CAPTURE_POINTS, HARVEST_MODEL, Api, api_client, register_worker, submit_harvest
from tests.utils.services import Services

HARVEST = ("harvest",)  # what a default key has


@pytest.fixture(scope="module", autouse=True)
def harvest_worker(services: Services) -> None:
    register_worker(services.sessions, HARVEST_MODEL, capture_points=CAPTURE_POINTS)
    register_worker(services.sessions, "transformers-model")  # a worker that runs no harvests


def spec(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model_key": HARVEST_MODEL,
        "dataset": {"prompts": ["one", "two", "three", "four", "five"]},
        "captures": [{"module": "model.layers.1"}],
        "prompts_per_chunk": 2,
    }
    body.update(overrides)
    return body


def put_user_file(services: Services, owner: str, name: str, data: bytes) -> str:
    key = f"users/{owner}/{name}"
    services.store.put_bytes(key, data)
    return key


def test_a_harvest_is_frozen_split_and_queued(api: Api, services: Services) -> None:
    alice = api.new_key("alice", HARVEST)
    tokens_before = ready_messages(services.celery, bulk_queue_name(HARVEST_MODEL))
    response = submit_harvest(api.http, alice, spec())
    assert response.status_code == 201, response.text
    harvest = response.json()
    assert harvest["status"] == "queued" and harvest["progress"]["chunks_total"] == 3
    assert harvest["progress"]["prompts_total"] == 5 and harvest["progress"]["eta_s"] is None
    assert ready_messages(services.celery, bulk_queue_name(HARVEST_MODEL)) == tokens_before + 3

    with services.sessions() as session:
        chunks = list(
            session.scalars(
                select(HarvestChunk).where(HarvestChunk.harvest_id == harvest["id"]).order_by(HarvestChunk.index)
            )
        )
    assert [(c.first_prompt, c.prompts, c.status) for c in chunks] == [
        (0, 2, JobStatus.QUEUED),
        (2, 2, JobStatus.QUEUED),
        (4, 1, JobStatus.QUEUED),
    ]
    assert chunks[1].shard_key == f"harvests/{harvest['id']}/shard-00001.safetensors"
    dataset = f"harvests/{harvest['id']}/dataset.jsonl"
    assert read_slice(services.store.get_bytes(dataset, chunks[1].dataset_start, chunks[1].dataset_end)) == [
        "three",
        "four",
    ]

    bob = api.new_key("bob", HARVEST)
    assert api.http.get(f"/v1/harvests/{harvest['id']}", headers=bob).status_code == 404
    assert [h["id"] for h in api.http.get("/v1/harvests", headers=alice).json()["harvests"]] == [harvest["id"]]
    assert api.http.get(f"/v1/harvests/{harvest['id']}/manifest", headers=alice).status_code == 409

    cancelled = api.http.post(f"/v1/harvests/{harvest['id']}/cancel", headers=alice)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    with services.sessions() as session:
        statuses = session.scalars(select(HarvestChunk.status).where(HarvestChunk.harvest_id == harvest["id"]))
        assert set(statuses) == {JobStatus.CANCELLED}
    assert api.http.post(f"/v1/harvests/{harvest['id']}/cancel", headers=alice).status_code == 409


def test_files_from_the_store_jsonl_parquet_text_and_uploads(api: Api, services: Services) -> None:
    carol = api.new_key("carol", HARVEST)
    jsonl = put_user_file(services, "carol", "a.jsonl", b'{"text": "x"}\n{"text": "y", "n": 2}\n\n{"text": "z"}\n')
    buffer = io.BytesIO()
    pq.write_table(pa.table({"body": ["p", "q", "r", "s"], "id": [1, 2, 3, 4]}), buffer)
    parquet = put_user_file(services, "carol", "b.parquet", buffer.getvalue())
    text = put_user_file(services, "carol", "c.txt", b"first line\n\nsecond line\n")
    for dataset, prompts in (
        ({"path": jsonl}, 3),
        ({"path": parquet, "field": "body", "offset": 1, "limit": 2}, 2),
        ({"path": text}, 2),
        ({"token_ids": [[1, 2, 3], [4]]}, 2),
    ):
        response = submit_harvest(api.http, carol, spec(dataset=dataset))
        assert response.status_code == 201, response.text
        assert response.json()["progress"]["prompts_total"] == prompts
    uploaded = submit_harvest(api.http, carol, spec(dataset={}), upload=("mine.txt", b"u1\nu2\nu3\n"))
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["spec"]["dataset"]["path"].startswith("users/carol/uploads/")
    kept = uploaded.json()["spec"]["dataset"]["path"]
    assert services.store.get_bytes(kept) == b"u1\nu2\nu3\n"  # kept, so that later specs can name it


def test_a_spec_without_dataset_harvests_the_uploaded_file_and_needs_one(api: Api) -> None:
    """`nnqueue harvest submit spec.yaml --dataset corpus.txt` with no `dataset:` in the spec (it was 422, Field
    required, unless the spec said `dataset: {}`); without a file there is nothing to harvest, and a schedule, which
    uploads none, needs a source when it is created rather than failing at every run."""
    erin = api.new_key("erin", HARVEST)
    without = {key: value for key, value in spec().items() if key != "dataset"}
    uploaded = submit_harvest(api.http, erin, without, upload=("corpus.txt", b"first\nsecond\n"))
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["progress"]["prompts_total"] == 2
    assert uploaded.json()["spec"]["dataset"]["path"].startswith("users/erin/uploads/")
    nothing = submit_harvest(api.http, erin, without)
    assert nothing.status_code == 422 and "the dataset has no source" in nothing.text, nothing.text
    scheduled = api.http.post("/v1/schedules", headers=erin, json={"name": "n", "cron": "0 3 * * *", "spec": without})
    assert scheduled.status_code == 422 and "a schedule's dataset needs a source" in scheduled.text, scheduled.text


def test_a_store_that_fails_the_write_is_a_503_that_says_so_and_keeps_nothing(services: Services) -> None:
    refused = {**services.settings.model_dump()["s3"], "secret_access_key": "not-the-key"}
    with api_client(services, s3=refused) as api:
        fiona = api.new_key("fiona", HARVEST)
        response = submit_harvest(api.http, fiona, spec())
    assert response.status_code == 503, response.text
    assert "the object store failed the request; try again later (ClientError" in response.json()["detail"]
    with services.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Harvest).where(Harvest.owner == "fiona")) == 0


def test_an_upload_that_does_not_parse_is_refused_and_not_kept(api: Api, services: Services) -> None:
    dave = api.new_key("dave", HARVEST)
    for name, data, reason in (
        ("bad.jsonl", b'{"text": "x"}\nnot json\n', "line 2 is not JSON"),
        ("bad.txt", b"\xff\xfe not utf-8", "is not UTF-8"),
        ("empty.txt", b"\n\n", "the dataset is empty"),
    ):
        response = submit_harvest(api.http, dave, spec(dataset={}), upload=(name, data))
        assert response.status_code == 422 and reason in response.text, response.text
    assert services.store.list_keys("users/dave/") == []  # parsed from the request's bytes before any PUT


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (
            spec(captures=[{"module": "model.layers.7"}]),
            422,
            "capturable modules: ['model.embed_tokens', 'model.layers.0'",
        ),
        (spec(captures=[{"module": "model.embed_tokens", "part": "hidden"}]), 422, "not capturable"),
        (spec(captures=[{"module": "model.layers.0"}, {"module": "model.layers.0"}]), 422, "more than once"),
        (spec(dataset={"prompts": []}), 422, "the dataset is empty"),
        (spec(dataset={"prompts": ["a"], "offset": 1}), 422, "empty after offset 1"),
        (
            spec(dataset={"path": "users/dave/a.jsonl", "field": "missing"}),
            422,
            "has no field 'missing'; it has ['text']",
        ),
        (
            spec(dataset={"path": "users/dave/b.parquet", "field": "nope"}),
            422,
            "has no column 'nope'; its columns: ['body']",
        ),
        (spec(dataset={"path": "users/erin/secret.txt"}), 403, "not under your prefix 'users/dave/'"),
        (spec(dataset={"path": "users/dave/none.txt"}), 404, "no file 'users/dave/none.txt'"),
        (spec(dataset={"prompts": ["a"] * 11}), 413, "the limit is 10 (NNQUEUE_HARVEST_MAX_PROMPTS)"),
        (spec(dataset={"path": "users/dave/big.txt"}), 413, "NNQUEUE_HARVEST_MAX_DATASET_BYTES"),
        (spec(model_key="nobody-serves-this"), 400, "no live worker serves model 'nobody-serves-this'"),
        (spec(model_key="transformers-model"), 400, "run no harvests"),
        (spec(selection={"kind": "positions"}), 422, "needs at least one position"),
        (spec(dtype="int8"), 422, "dtype must be one of"),
        (spec(selection={"tokens": "generated"}), 422, "a selection of 'generated' tokens needs 'generate'"),
        (spec(generate={"max_tokens": 0}), 422, "max_tokens must be a positive integer"),
        (spec(generate={"max_tokens": 4, "temperature": -1}), 422, "temperature must be a number >= 0"),
        (spec(selection={"tokens": "response"}), 422, "'prompt', 'generated' or 'both'"),
        ({**spec(), "surprise": 1}, 422, "surprise"),
        ({**spec(), "metadata": {"x": float("nan")}}, 422, "NaN is not JSON"),
    ],
)
def test_bad_specs_are_refused_with_reasons(services: Services, body: dict[str, Any], status: int, reason: str) -> None:
    put_user_file(services, "dave", "a.jsonl", b'{"text": "x"}\n')
    buffer = io.BytesIO()
    pq.write_table(pa.table({"body": ["p"]}), buffer)
    put_user_file(services, "dave", "b.parquet", buffer.getvalue())
    put_user_file(services, "dave", "big.txt", b"line\n" * 400)
    put_user_file(services, "erin", "secret.txt", b"erin's data\n")
    with api_client(services, worker_stale_after_s=3600, harvest_max_prompts=10, harvest_max_dataset_bytes=1000) as api:
        response = submit_harvest(api.http, api.new_key("dave", HARVEST), body)
    assert response.status_code == status, response.text
    assert reason in json.dumps(response.json()["detail"])


def test_schedules_fire_runs_until_paused(api: Api, services: Services) -> None:
    frank = api.new_key("frank", HARVEST)
    put_user_file(services, "frank", "daily/1.txt", b"a\nb\n")
    put_user_file(services, "frank", "daily/2.txt", b"c\n")
    body = {"name": "daily", "cron": "* * * * * */1", "spec": spec(dataset={"prefix": "users/frank/daily/"})}
    assert api.http.post("/v1/schedules", headers=frank, json={**body, "cron": "every day"}).status_code == 422
    created = api.http.post("/v1/schedules", headers=frank, json=body)
    assert created.status_code == 201, created.text
    schedule_id = created.json()["id"]
    assert api.http.get(f"/v1/schedules/{schedule_id}", headers=api.new_key("grace", HARVEST)).status_code == 404

    def make_due() -> None:  # as a second passing would
        with transaction(services.sessions) as session:
            schedule = session.get(HarvestSchedule, schedule_id)
            assert schedule is not None
            schedule.next_run_at = schedule.created_at

    limits = Limits(max_bytes=10**6, max_prompts=100)
    fired = []
    for _ in range(2):  # fire_due as the beat calls it (the beat process itself: the next test)
        make_due()
        fired += fire_due(services.sessions, services.store, services.celery, limits=limits, stale_after_s=3600)
    assert fired == [schedule_id, schedule_id]
    runs = api.http.get("/v1/harvests", headers=frank).json()["harvests"]
    assert len(runs) == 2 and all(
        run["schedule_id"] == schedule_id and run["progress"]["prompts_total"] == 3 for run in runs
    )
    listed = api.http.get("/v1/schedules", headers=frank).json()["schedules"]
    assert listed[0]["runs"] == 2 and listed[0]["last_harvest_id"] in {run["id"] for run in runs}

    assert api.http.post(f"/v1/schedules/{schedule_id}/pause", headers=frank).json()["paused"] is True
    make_due()
    assert fire_due(services.sessions, services.store, services.celery, limits=limits, stale_after_s=3600) == []
    resumed = api.http.post(f"/v1/schedules/{schedule_id}/resume", headers=frank).json()
    assert resumed["paused"] is False
    assert api.http.delete(f"/v1/schedules/{schedule_id}", headers=frank).status_code == 204
    assert api.http.get("/v1/schedules", headers=frank).json()["schedules"] == []


def test_the_beat_process_fires_a_short_interval_schedule_and_stops_when_paused(api: Api, services: Services) -> None:
    heidi = api.new_key("heidi", HARVEST)
    body = {"name": "every second", "cron": "* * * * * */1", "spec": spec()}
    schedule_id = api.http.post("/v1/schedules", headers=heidi, json=body).json()["id"]
    stop = threading.Event()
    settings = services.settings.model_copy(update={"beat_interval_s": 0.2, "worker_stale_after_s": 3600})
    beat = threading.Thread(target=run_beat, args=(settings, stop), daemon=True)
    beat.start()
    try:
        deadline = time.monotonic() + 30
        while len(api.http.get("/v1/harvests", headers=heidi).json()["harvests"]) < 2:
            assert time.monotonic() < deadline, "the beat did not fire the schedule twice in 30 s"
            time.sleep(0.2)
        api.http.post(f"/v1/schedules/{schedule_id}/pause", headers=heidi)
        time.sleep(0.5)  # a run the beat was already creating when the pause landed
        runs = len(api.http.get("/v1/harvests", headers=heidi).json()["harvests"])
        time.sleep(2.5)
        assert len(api.http.get("/v1/harvests", headers=heidi).json()["harvests"]) == runs
    finally:
        stop.set()
        beat.join(timeout=10)


def test_harvest_routes_need_the_harvest_scope_and_other_owners_need_admin(api: Api) -> None:
    ivan, admin = api.new_key("ivan", HARVEST), api.new_key("root", ("admin",))  # admin alone: no submitting
    trace_only = api.new_key("judy", ("trace",))
    for method, path in (("POST", "/v1/harvests"), ("GET", "/v1/harvests"), ("GET", "/v1/schedules")):
        refused = api.http.request(method, path, headers=trace_only)
        assert refused.status_code == 403 and "lacks the 'harvest' scope" in refused.json()["detail"], refused.text
    harvest = submit_harvest(api.http, ivan, spec()).json()
    body = {"name": "ivan's", "cron": "0 3 * * *", "spec": spec()}
    schedule = api.http.post("/v1/schedules", headers=ivan, json=body).json()

    for path in ("/v1/harvests?owner=root", "/v1/schedules?owner=root"):
        refused = api.http.get(path, headers=ivan)
        assert refused.status_code == 403 and "lacks the 'admin' scope" in refused.json()["detail"]
    everyone = api.http.get("/v1/harvests", headers=admin).json()["harvests"]
    assert harvest["id"] in {h["id"] for h in everyone}
    only_ivan = api.http.get("/v1/harvests?owner=ivan", headers=admin).json()["harvests"]
    assert {h["owner"] for h in only_ivan} == {"ivan"}
    assert api.http.get(f"/v1/harvests/{harvest['id']}", headers=admin).status_code == 200
    schedules = api.http.get("/v1/schedules?owner=ivan", headers=admin).json()["schedules"]
    assert [s["id"] for s in schedules] == [schedule["id"]]
    assert api.http.post(f"/v1/schedules/{schedule['id']}/pause", headers=admin).json()["paused"] is True
    assert api.http.post(f"/v1/harvests/{harvest['id']}/cancel", headers=admin).json()["status"] == "cancelled"
    assert submit_harvest(api.http, admin, spec()).status_code == 403


WIDE_POINTS = [
    {"module": "model.layers.0", "io": "output", "parts": ["residual_stream", "hidden", "residual"], "width": 64},
    {"module": "model.layers.0.mlp", "io": "output", "parts": [], "width": None},
]


def test_a_dry_run_estimates_without_queueing_and_a_limit_refuses_with_the_estimate(
    api: Api, services: Services
) -> None:
    register_worker(services.sessions, "wide-model", capture_points=WIDE_POINTS)
    alice = api.new_key("alice", HARVEST)
    body = spec(
        model_key="wide-model",
        dataset={"token_ids": [[1] * 10, [2] * 3, [3] * 40]},
        captures=[{"module": "model.layers.0"}, {"module": "model.layers.0.mlp"}],
        selection={"kind": "all", "skip": 2},
        dtype="bfloat16",
        max_length=32,
    )
    with services.sessions() as session:
        chunks_before = session.scalar(select(func.count()).select_from(HarvestChunk))
    response = api.http.post("/v1/harvests/estimate", headers=alice, data={"spec": json.dumps(body)})
    assert response.status_code == 200, response.text
    found = response.json()
    rows = 8 + 1 + 30  # skip 2 of 10, 3 and 40 cut at 32 tokens
    assert (found["prompts"], found["tokens"], found["tokens_exact"], found["rows"]) == (3, 45, True, rows)
    # The mlp's width is not published: counted at the model's widest (64); bfloat16, plus three int64 columns.
    assert found["widths"] == {"model.layers.0.output": 64, "model.layers.0.mlp.output": 64}
    assert found["bytes"] == rows * (2 * 64 * 2 + 24) + 2 * 1024 and found["shards"] == 2
    assert found["duration_s"] is None and any("no chunk" in note for note in found["notes"])
    with services.sessions() as session:
        assert session.scalar(select(func.count()).select_from(HarvestChunk)) == chunks_before

    text = spec(model_key="wide-model", dataset={"prompts": ["x" * 100]}, captures=[{"module": "model.layers.0"}])
    guessed = api.http.post("/v1/harvests/estimate", headers=alice, data={"spec": json.dumps(text)}).json()
    assert guessed["tokens"] == 30 and guessed["tokens_exact"] is False
    unknown = api.http.post(
        "/v1/harvests/estimate", headers=alice, data={"spec": json.dumps(spec(captures=[{"module": "nope"}]))}
    )
    assert unknown.status_code == 422 and "nope" in unknown.text

    with api_client(services, worker_stale_after_s=3600, harvest_max_output_bytes=10_000) as limited:
        refused = submit_harvest(limited.http, alice, body)
        assert refused.status_code == 413, refused.text
        assert "would write about" in refused.text and f"{rows:,} rows" in refused.text
        assert (
            submit_harvest(limited.http, alice, {**body, "captures": [{"module": "model.layers.0"}]}).status_code == 201
        )


def test_an_estimate_counts_the_generated_tokens(api: Api, services: Services) -> None:
    register_worker(services.sessions, "wide-model", capture_points=WIDE_POINTS)
    body = spec(
        model_key="wide-model",
        dataset={"token_ids": [[1] * 10, [2] * 3, [3] * 40]},
        captures=[{"module": "model.layers.0"}],
        selection={"kind": "all", "skip": 2, "tokens": "generated"},
        generate={"max_tokens": 5, "temperature": 0.7, "seed": 3},
        max_length=32,
    )
    response = api.http.post(
        "/v1/harvests/estimate", headers=api.new_key("alice", HARVEST), data={"spec": json.dumps(body)}
    )
    assert response.status_code == 200, response.text
    found = response.json()
    # 45 prompt tokens, and 4 generated tokens per prompt run through the model (the 5th is sampled, never run).
    assert (found["tokens"], found["rows"]) == (45 + 3 * 4, 3 * 4)
    assert found["bytes"] == 12 * (64 * 4 + 24) + 2 * 1024
    assert any("up to 5 tokens per prompt" in note for note in found["notes"])
    both = {**body, "selection": {"kind": "last", "n": 6, "tokens": "both"}}
    found = api.http.post(
        "/v1/harvests/estimate", headers=api.new_key("alice", HARVEST), data={"spec": json.dumps(both)}
    )
    assert found.json()["rows"] == 3 * 6


def test_a_schedule_naming_another_owners_files_is_refused_at_creation(api: Api) -> None:
    mallory = api.new_key("mallory", HARVEST)
    for dataset in ({"prefix": "users/alice/"}, {"path": "users/alice/secret.jsonl"}):
        body = {"name": "theirs", "cron": "0 3 * * *", "spec": spec(dataset=dataset)}
        refused = api.http.post("/v1/schedules", headers=mallory, json=body)
        assert refused.status_code == 403, refused.text
        assert "is not under your prefix 'users/mallory/'" in refused.json()["detail"]
    assert api.http.get("/v1/schedules", headers=mallory).json()["schedules"] == []
    # Files of one's own that do not exist yet are fine: they are read when the schedule fires.
    mine = {"name": "mine", "cron": "0 3 * * *", "spec": spec(dataset={"prefix": "users/mallory/later/"})}
    assert api.http.post("/v1/schedules", headers=mallory, json=mine).status_code == 201


def test_harvests_in_flight_and_schedules_kept_are_capped_per_key(services: Services) -> None:
    with api_client(
        services, worker_stale_after_s=3600, max_harvests_in_flight_per_key=2, max_schedules_per_key=1
    ) as api:
        ivan, judy = api.new_key("ivan", HARVEST), api.new_key("judy", HARVEST)
        for _ in range(2):
            assert submit_harvest(api.http, ivan, spec()).status_code == 201
        over = submit_harvest(api.http, ivan, spec())
        assert over.status_code == 429 and "NNQUEUE_MAX_HARVESTS_IN_FLIGHT_PER_KEY" in over.json()["detail"]
        assert submit_harvest(api.http, judy, spec()).status_code == 201  # per key

        body = {"name": "nightly", "cron": "0 3 * * *", "spec": spec()}
        assert api.http.post("/v1/schedules", headers=ivan, json=body).status_code == 201
        over = api.http.post("/v1/schedules", headers=ivan, json=body)
        assert over.status_code == 429 and "NNQUEUE_MAX_SCHEDULES_PER_KEY" in over.json()["detail"]
        assert api.http.post("/v1/schedules", headers=judy, json=body).status_code == 201
