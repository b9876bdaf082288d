"""What a job alone in the step that crashed the engine is failed with, from the engine's own crash report
(written by nnqueue.enginecore.crash_report, read and settled by nnqueue.workers.engine_health), on both databases."""

from __future__ import annotations

from pathlib import Path

import pytest

from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import make_engine, session_factory
from nnqueue.enginecore.crash_report import CRASH_DIR_ENV, write_report
from nnqueue.workers.engine_health import EngineHealth
from tests.utils.queued import claim_next_job, queue_job


def crash_alone(database: str, crash_dir: Path, error: BaseException, monkeypatch: pytest.MonkeyPatch) -> Job:
    sessions = session_factory(make_engine(database))
    job_id = queue_job(sessions, "m")
    assert claim_next_job(sessions, "m", "w1") is not None
    monkeypatch.setenv(CRASH_DIR_ENV, str(crash_dir))
    write_report([f"{job_id}-1-0"], error)  # as the engine writes it when the step raises
    stopped: list[bool] = []
    health = EngineHealth(sessions, None, "w1", "m", crash_dir, stop=lambda: stopped.append(True))  # type: ignore[arg-type]
    health._heal()
    assert stopped == [True]
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_a_host_problem_is_not_held_against_the_job(
    any_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the engine user may not read is the host's set-up: not an EngineCrash (which the crash cool-down
    counts against the job's key), and the message says whose problem it is."""
    job = crash_alone(any_database, tmp_path, PermissionError(13, "Permission denied", "/root/.pyenv"), monkeypatch)
    assert job.status is JobStatus.FAILED and job.error_type == "EngineHostError", job.error_type
    assert "host's set-up, not in this job's code" in (job.error_message or "")


def test_an_error_of_the_engine_on_the_jobs_input_is_an_engine_crash(
    any_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = crash_alone(any_database, tmp_path, RuntimeError("shape mismatch in the forward"), monkeypatch)
    assert job.status is JobStatus.FAILED and job.error_type == "EngineCrash", job.error_type
    assert "shape mismatch" in (job.error_message or "")
