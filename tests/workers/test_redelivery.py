"""A worker SIGKILLed mid-job loses nothing: a live worker requeues the job at its next heartbeat (without
waiting for the broker's visibility timeout) and completes it exactly once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import pytest
from sqlalchemy import select

from nnqueue.db.models import JobEvent, JobStatus
from tests.utils.payloads import slow_payload
from tests.utils.services import Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # crash and redelivery: kills a worker process and starts another

S = JobStatus


@pytest.fixture(scope="module")
def services(services: Services) -> Services:
    """Workers whose broker redelivers an unacknowledged message only after an hour: within this test, only
    the live worker's sweep (nnqueue.scheduler.recovery) can bring the killed worker's job back."""
    services.env["NNQUEUE_BROKER_VISIBILITY_TIMEOUT_S"] = "3600"
    return services


def test_a_killed_workers_job_is_requeued_and_completes_exactly_once(
    services: Services, start_worker: Callable[..., WorkerProcess], client_model: VLLM
) -> None:
    first = start_worker(max_concurrent_jobs=2)
    payload = slow_payload(client_model, steps=60)  # about 6 s of decoding: long enough to be killed mid-job
    job = services.submit(payload)
    running = services.wait_for(job.id, {S.RUNNING})
    first_worker = first.wait_registered()
    assert running.worker_id == first_worker.id

    engine_processes = first.children()
    assert engine_processes, "the worker runs its engine in a child process"
    first.kill()
    # The orphaned engine notices its worker is gone and exits, freeing the model's memory.
    _, alive = psutil.wait_procs(engine_processes, timeout=20)
    assert alive == []
    second = start_worker(max_concurrent_jobs=2)
    second_worker = second.wait_registered()

    done = services.wait_for(job.id, {S.COMPLETED, S.FAILED}, timeout=180)
    assert done.status is S.COMPLETED, (done.error_type, done.error_message, done.error_traceback)
    assert done.worker_id == second_worker.id and done.attempts == 2
    assert services.store.size(done.result_key) == done.result_size
    with services.sessions() as session:
        history = session.execute(
            select(JobEvent.to_status, JobEvent.detail).where(JobEvent.job_id == job.id).order_by(JobEvent.id)
        ).all()
    assert [status for status, _ in history] == [S.QUEUED, S.RUNNING, S.QUEUED, S.RUNNING, S.COMPLETED]
    assert history[2].detail == {"reason": f"worker {first_worker.id} lost"}
