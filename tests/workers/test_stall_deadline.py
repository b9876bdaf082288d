"""The hard step deadline: intervention code blocked in C past the stall timeout is stopped by killing its engine
(nnqueue.workers.stall_deadline); its job fails with ``InterventionStalled``, the job that shared its engine runs
again on the fresh engine the worker starts and completes. The stall watchdog's exception alone cannot stop either: a sleep
never returns to bytecode, and a regular expression holds the GIL (the engine's own threads cannot run)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from nnqueue.db.models import JobStatus
from nnqueue.workers.engine_health import read_crash_report
from nnqueue.workers.stall_deadline import StallDeadline
from tests.utils.payloads import PROMPTS, PrebuiltBackend, slow_payload
from tests.utils.services import Services, WorkerProcess

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

S = JobStatus


def sleeping_payload(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        time.sleep(1000)  # in C: the watchdog's exception never lands
    return backend.payload


def regex_payload(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking, in C, holding the GIL
    return backend.payload


def submit(services: Services, payload: bytes, owner: str) -> uuid.UUID:
    return services.submit(payload, owner=owner, timeout_s=900).id


JOB = uuid.UUID("12345678-1234-5678-1234-567812345678")
STUCK = """
import sys, time
from pathlib import Path
from nnqueue.enginecore.stall_beacon import Beacon
beacon = Beacon(Path(sys.argv[1]))
beacon.publish(time.monotonic(), sys.argv[2])  # as the stall watchdog does on entering a switch
time.sleep(1000)
"""


def test_a_process_in_users_code_past_the_deadline_is_killed_and_its_request_reported(tmp_path: Path) -> None:
    stuck = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path), f"{JOB}-1-0-0123abcd"])
    deadline = StallDeadline(tmp_path, stall_timeout_s=0.5)
    deadline.start()
    try:
        assert stuck.wait(timeout=120) == -9  # SIGKILL
    finally:
        stuck.kill()
    deadline.join(timeout=30)
    report = read_crash_report(tmp_path, wait_s=0)
    assert report is not None and report.cause == "stall" and report.jobs == {JOB}
    assert "more than 0.5 s without returning control to the model" in report.error


@pytest.mark.slow  # a real worker process whose engine is killed twice
@pytest.mark.timeout(1800)  # two engine restarts
def test_code_blocked_in_c_fails_its_job_and_the_other_jobs_complete(
    services: Services, start_worker: Callable[..., WorkerProcess], client_model: VLLM
) -> None:
    worker = start_worker(max_concurrent_jobs=4)  # its own: its engine is killed (stall timeout: 3 s)
    registered = worker.wait_registered()
    for stall in (sleeping_payload, regex_payload):  # the second on the fresh engine the worker started
        # A job of the staller's owner shares the engine's steps with it (its trust domain); another owner's
        # waits for the engine to switch domains, which the stalled step holds up.
        beside = submit(services, slow_payload(client_model, steps=100), "mallory")
        services.wait_for(beside, {S.RUNNING}, timeout=600)
        staller = submit(services, stall(client_model), "mallory")
        waiting = submit(services, slow_payload(client_model, steps=2), "alice")

        failed = services.wait_for(staller, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=600)
        assert failed.status is S.FAILED and failed.error_type == "InterventionStalled", (
            failed.error_type,
            failed.error_message,
        )
        assert "more than 3 s without returning control to the model" in failed.error_message
        assert "could not be interrupted" in failed.error_message
        assert failed.started_at is not None and failed.finished_at is not None
        stopped_s = (failed.finished_at - failed.started_at).total_seconds()
        print(f"{stall.__name__}: its job failed {stopped_s:.1f} s after it started (stall timeout 3 s)")

        for job_id in (beside, waiting):
            done = services.wait_for(job_id, {S.COMPLETED, S.FAILED, S.CANCELLED}, timeout=900)
            assert done.status is S.COMPLETED, (done.error_type, done.error_message)
        assert services.job(beside).attempts == 2  # requeued from the killed engine, run again on a fresh one
    log = worker.log()
    assert log.count("killing engine process") == 2 and log.count("a fresh engine serves") == 2, log[-5000:]
    assert worker.wait_registered().id == registered.id and "starting it again" not in log  # the same worker
