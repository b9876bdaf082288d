"""``/metrics``: the API's counters move with submissions and cancels, the queue's gauges follow the database,
and several API processes (``serve-api --workers 2``) report the same totals, whichever answers."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nnqueue.db.lifecycle import transition
from nnqueue.db.models import JobStatus
from nnqueue.db.session import transaction
from tests.utils.api import LIVE_MODEL, Api, api_client, api_command, create_secret, register_worker
from tests.utils.payloads import fake_trace
from tests.utils.servers import free_ports
from tests.utils.services import Services

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def api(services: Services) -> Iterator[Api]:
    """Payloads of over 64 bytes go to the object store (and count as bytes written to it)."""
    with api_client(services, worker_stale_after_s=3600, inline_payload_max_bytes=64) as client:
        yield client


def test_metrics_follow_submissions_cancels_and_the_queue(api: Api, services: Services) -> None:
    register_worker(services.sessions, capacity=4)
    alice = api.new_key("alice")
    trace = {"model": LIVE_MODEL, "kind": "trace"}
    before = scrape(api.http.get("/metrics").text)

    jobs = [api.submit_ok(alice, fake_trace(b"x" * 100)) for _ in range(3)]
    api.submit_ok(alice, fake_trace(b"kept in the database"))
    assert api.http.post(f"/v1/jobs/{jobs[0]['id']}/cancel", headers=alice).status_code == 200
    with transaction(services.sessions) as session:  # a worker takes the second one
        transition(session, uuid.UUID(jobs[1]["id"]), JobStatus.RUNNING, worker_id="w")
    time.sleep(0.05)  # the oldest queued job is measurably old

    response = api.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    after = scrape(response.text)
    moved = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    assert moved("nnqueue_jobs_submitted_total", **trace) == 4
    assert moved("nnqueue_jobs_finished_total", **trace, status="cancelled") == 1
    assert moved("nnqueue_store_bytes_written_total", what="payload") == 3 * len(fake_trace(b"x" * 100))
    assert value(after, "nnqueue_queue_stats_up") == 1
    assert value(after, "nnqueue_queue_depth", model=LIVE_MODEL) >= 1
    assert value(after, "nnqueue_jobs_running", model=LIVE_MODEL) >= 1
    assert value(after, "nnqueue_queue_oldest_age_seconds", model=LIVE_MODEL) > 0.05
    assert value(after, "nnqueue_live_workers", model=LIVE_MODEL) >= 1
    assert value(after, "nnqueue_worker_capacity", model=LIVE_MODEL) >= 4


def test_a_scale_to_zero_model_has_its_gauges_while_idle(services: Services) -> None:
    """KEDA reads these for a model with no worker and no work: zeros, not an empty answer (which the ScaledObjects
    in deploy/kubernetes treat as "not scraped", an error), so an idle model is told from an unscraped one."""
    with api_client(services, scale_to_zero_models=["idle-model"]) as api:
        samples = scrape(api.http.get("/metrics").text)
    for name in ("nnqueue_queue_depth", "nnqueue_jobs_running", "nnqueue_queue_oldest_age_seconds"):
        assert (name, frozenset({("model", "idle-model")})) in samples and value(samples, name, model="idle-model") == 0
    assert ("nnqueue_harvest_chunks_queued", frozenset({("model", "idle-model")})) in samples


@pytest.fixture
def two_process_api(services: Services) -> Iterator[str]:
    [port] = free_ports(1)
    env = {**os.environ, **services.env, "NNQUEUE_WORKER_STALE_AFTER_S": "3600"}
    with api_command(["serve-api", "--port", str(port), "--workers", "2"], env, port) as url:
        yield url


def test_several_api_processes_report_the_same_totals(two_process_api: str, services: Services) -> None:
    register_worker(services.sessions, "multiprocess-model", capacity=1)
    headers = {"Authorization": f"Bearer {create_secret(services.sessions, 'bob')}"}
    spec = json.dumps({"model_key": "multiprocess-model"})
    submitted = 12
    for _ in range(submitted):  # a fresh connection each time: the processes take turns accepting them
        response = httpx.post(
            f"{two_process_api}/v1/jobs",
            headers=headers,
            data={"spec": spec},
            files={"payload": ("t", fake_trace(b"p"))},
        )
        assert response.status_code == 201, response.text
    labels = {"model": "multiprocess-model", "kind": "trace"}
    reported = {
        value(scrape(httpx.get(f"{two_process_api}/metrics").text), "nnqueue_jobs_submitted_total", **labels)
        for _ in range(8)
    }
    assert reported == {submitted}
