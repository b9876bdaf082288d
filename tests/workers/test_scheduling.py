"""Scheduling with a real worker process and a Redis server of this module's own, which it restarts empty:
jobs accepted before the restart all finish (the reconciler re-sends their tokens), and a higher-priority
job queued later runs before a lower-priority one queued earlier."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from nnqueue.db.models import JobStatus
from nnqueue.scheduler import registry
from nnqueue.settings import S3Settings
from tests.utils import servers
from tests.utils.payloads import slow_payload, two_invoke_payload
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # end to end: a real worker process, Redis restarted under it

S = JobStatus


@pytest.fixture(scope="module")
def redis_server() -> Iterator[list[servers.RedisServer]]:
    """A one-element list, so that a test can swap in the restarted server (same port, so same URL)."""
    holder = [servers.start_redis()]
    yield holder
    holder[0].stop()


@pytest.fixture(scope="module")
def services(
    database_factory: Callable[[], str], redis_server: list[servers.RedisServer], s3_settings: S3Settings
) -> Services:
    s3 = s3_settings.model_copy(update={"bucket": f"nnqueue-{uuid.uuid4().hex[:8]}"})
    return Services(database_factory(), redis_server[0].url, s3)


@pytest.fixture(scope="module")
def one_worker(start_worker: Callable[..., WorkerProcess]) -> Callable[[], WorkerProcess]:
    """The module's single worker (one job slot), started when a test first asks for it."""
    started: list[WorkerProcess] = []

    def get() -> WorkerProcess:
        if not started:
            started.append(start_worker(max_concurrent_jobs=1))
        return started[0]

    return get


def test_jobs_accepted_before_redis_restarted_empty_all_finish(
    services: Services,
    redis_server: list[servers.RedisServer],
    one_worker: Callable[[], WorkerProcess],
    client_model: VLLM,
) -> None:
    # Accepted while a worker row of the model was live (admission asks for one); no process serves it yet.
    registry.register(services.sessions, registry.new_worker_id(), MODEL_KEY, "q", 1)
    payload = two_invoke_payload(client_model)
    jobs = [services.submit(payload, timeout_s=120).id for _ in range(5)]
    redis_server[0] = servers.restart_redis_empty(redis_server[0])  # no persistence: the 5 tokens are gone

    started = time.monotonic()
    worker = one_worker()  # a fresh worker, started after the restart
    for job_id in jobs:
        done = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=180)
        assert done.status is S.COMPLETED, (done.error_type, done.error_message)
    print(
        f"Redis restarted empty with 5 queued jobs: a fresh worker finished all 5 {time.monotonic() - started:.1f} s later"
    )
    assert "the broker lacked tokens for 5 queued jobs and 0 queued chunks" in worker.log()


def test_a_higher_priority_job_queued_later_runs_first(
    services: Services, one_worker: Callable[[], WorkerProcess], client_model: VLLM
) -> None:
    one_worker()
    blocker = services.submit(slow_payload(client_model, steps=30), timeout_s=120).id  # the only slot, ~3 s
    services.wait_for(blocker, {S.RUNNING})
    payload = two_invoke_payload(client_model)
    low = services.submit(payload, priority=0, timeout_s=120).id
    high = services.submit(payload, priority=5, timeout_s=120).id

    finished = {job_id: services.wait_for(job_id, {S.COMPLETED, S.FAILED}) for job_id in (blocker, low, high)}
    assert all(job.status is S.COMPLETED for job in finished.values())
    assert finished[high].started_at > finished[blocker].started_at  # it did wait for the slot ...
    assert finished[high].started_at < finished[low].started_at  # ... and then ran before the older job
    assert finished[high].queued_at > finished[low].queued_at
