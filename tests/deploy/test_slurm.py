"""deploy/slurm/nnqueue-worker.sbatch run as Slurm runs a batch script (bash, SLURM_* set, the signal to the script
alone as ``--signal=B:USR1`` sends it) against the test servers: the worker it starts takes a trace and a harvest
chunk; on the time limit's SIGUSR1 it hands both back to the queue after its drain, the script exits 0 and asks Slurm
to requeue the batch job (``scontrol``, a recording stand-in: there is no Slurm here), and another worker completes
both. ``scancel``'s SIGTERM stops the worker without a requeue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest
from sqlalchemy import select

from nnqueue.db.models import JobEvent, JobStatus, Worker
from tests.utils.payloads import slow_payload
from tests.utils.services import ENGINE_ARGS, MODEL_KEY, Services, WorkerProcess
from tests.workers.test_harvest import check_every_prompt_once, chunks_of, harvest, prompts, wait_chunk, wait_harvest

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # worker processes

S = JobStatus
SBATCH = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "nnqueue-worker.sbatch"
JOB_ID = "4242"


@pytest.fixture(scope="module")
def services(services: Services) -> Services:
    """Redis redelivers an unacknowledged token only after an hour: only the hand-back can bring the work back."""
    services.env["NNQUEUE_BROKER_VISIBILITY_TIMEOUT_S"] = "3600"
    return services


def start_batch_job(services: Services, model_path: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """The sbatch script under bash as slurmstepd starts it, with ``scontrol`` recording its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    env = {
        **os.environ,
        **services.env,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": JOB_ID,
        "NNQUEUE_COMMAND": f"{sys.executable} -m nnqueue",
        "NNQUEUE_MODEL": str(model_path),
        "NNQUEUE_MODEL_KEY": MODEL_KEY,
        "NNQUEUE_ENGINE_ARGS": " ".join(["--max-concurrent-jobs=2", *ENGINE_ARGS]),
        "NNQUEUE_WORKER_DRAIN_S": "2",
    }
    with open(tmp_path / "batch.log", "ab") as log:
        batch = subprocess.Popen(
            ["bash", str(SBATCH)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return batch, calls


def wait_registered(services: Services, batch: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert batch.poll() is None, f"the batch script exited with {batch.returncode}:\n{log.read_text()[-5000:]}"
        with services.sessions() as session:
            if session.scalar(select(Worker.id).where(Worker.model_key == MODEL_KEY, Worker.stopped_at.is_(None))):
                return
        time.sleep(0.5)
    raise AssertionError(f"the batch job's worker did not register in {timeout} s:\n{log.read_text()[-5000:]}")


def test_the_time_limits_signal_hands_the_jobs_and_chunks_back_and_requeues_the_batch_job(
    services: Services,
    client_model: VLLM,
    tiny_model_path: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    batch, calls = start_batch_job(services, tiny_model_path, tmp_path)
    try:
        wait_registered(services, batch, tmp_path / "batch.log")
        # 10 s of decoding (more under load, and beside the chunk): still running when the 2 s drain ends
        job = services.submit(slow_payload(client_model, steps=100))
        running = services.wait_for(job.id, {S.RUNNING}, timeout=240)
        token_ids = prompts(800, 200, seed=3)
        harvest_id = harvest(services, token_ids, prompts_per_chunk=400)
        held = wait_chunk(services, harvest_id, lambda chunk: chunk.status is S.RUNNING)
        assert held.worker_id == running.worker_id

        signalled = time.monotonic()
        batch.send_signal(signal.SIGUSR1)  # the batch shell only, as --signal=B:USR1@180 does
        # The worker that completes the work starts now, while the first drains: its engine loads for 30 s or more
        # (minutes on a busy machine), so it registers long after the first has handed back and exited (checked
        # below: the hand-back alone, not this worker, brings the job and the chunk back to QUEUED).
        second = WorkerProcess(services, tiny_model_path, tmp_path / "second.log", 2)
        request.addfinalizer(second.stop)  # should a check below fail before its own stop
        assert batch.wait(timeout=120) == 0, (tmp_path / "batch.log").read_text()[-5000:]
        print(f"the batch script exited 0, {time.monotonic() - signalled:.1f} s after SIGUSR1")
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
    assert calls.read_text().split() == ["requeue", JOB_ID]
    with services.sessions() as session:
        stopped = session.get(Worker, running.worker_id)
        assert stopped is not None and stopped.stopped_at is not None
    handed_back = services.job(job.id)
    assert handed_back.status is S.QUEUED, handed_back.status  # not left RUNNING under a stopped worker
    chunk = next(c for c in chunks_of(services, harvest_id) if c.index == held.index)
    assert chunk.status is S.QUEUED and chunk.error and f"worker {running.worker_id} stopped" in chunk.error
    with services.sessions() as session:  # nothing else could have: no other worker had registered yet
        assert session.scalars(select(Worker.id).where(Worker.stopped_at.is_(None))).all() == []

    try:
        second_id = second.wait_registered(timeout=600).id
        done = services.wait_for(job.id, {S.COMPLETED, S.FAILED}, timeout=240)
        assert done.status is S.COMPLETED, (done.error_type, done.error_message)
        assert done.worker_id == second_id and done.attempts == 2
        finished = wait_harvest(services, harvest_id)
    finally:
        second.stop()
    with services.sessions() as session:
        history = session.execute(
            select(JobEvent.to_status, JobEvent.detail).where(JobEvent.job_id == job.id).order_by(JobEvent.id)
        ).all()
    assert [status for status, _ in history] == [S.QUEUED, S.RUNNING, S.QUEUED, S.RUNNING, S.COMPLETED]
    assert history[2].detail["reason"].startswith(f"worker {running.worker_id} stopped: ")
    assert finished.status is S.COMPLETED, (finished.error_type, finished.error_message)
    check_every_prompt_once(services, finished, token_ids)
    rerun = next(c for c in chunks_of(services, harvest_id) if c.index == held.index)
    assert rerun.worker_id == second_id and rerun.attempts == 2


def test_scancel_stops_the_worker_for_good(services: Services, tiny_model_path: Path, tmp_path: Path) -> None:
    """``scancel``'s SIGTERM (also preemption's, which Slurm requeues itself where the partition says so) stops the
    worker and the script, and nothing asks Slurm to requeue the job. Sent while the worker starts: the script's
    decision does not wait for an engine."""
    batch, calls = start_batch_job(services, tiny_model_path, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not psutil.Process(batch.pid).children(recursive=True):  # the worker runs: the traps are set
            assert batch.poll() is None and time.monotonic() < deadline, (tmp_path / "batch.log").read_text()
            time.sleep(0.2)
        batch.send_signal(signal.SIGTERM)
        batch.wait(timeout=120)
    finally:
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
    log = (tmp_path / "batch.log").read_text()
    assert "after SIGTERM: scancel or preemption" in log, log[-3000:]
    assert not calls.exists(), calls.read_text()  # no `scontrol requeue`
