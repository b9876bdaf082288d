"""What a job alone in the step that crashed the engine is failed with, from the engine's own crash report
(written by nnqueue.enginecore.crash_report, read and settled by nnqueue.workers.engine_health), on both databases;
and what the worker does next: start a fresh engine, or stop when it cannot (a real engine's restart:
tests/workers/test_engine_restart.py); and a live engine replaced at a trust-domain switch."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import select

from nnqueue.db.models import Job, JobEvent, JobStatus
from nnqueue.db.session import make_engine, session_factory
from nnqueue.enginecore.crash_report import CRASH_DIR_ENV, write_report
from nnqueue.workers.engine_health import EngineHealth
from tests.utils.queued import claim_next_job, queue_job
from tests.utils.services import Services


def crash_alone(
    database: str,
    crash_dir: Path,
    error: BaseException,
    monkeypatch: pytest.MonkeyPatch,
    restart: Callable[[], Awaitable[None]] | None = None,
) -> tuple[Job, EngineHealth, list[bool]]:
    """A job claimed by worker w1, alone in the step that raised ``error``; the engine's death, healed. Returns the
    job as healed, the worker's health and whether it stopped."""
    sessions = session_factory(make_engine(database))
    job_id = queue_job(sessions, "m")
    assert claim_next_job(sessions, "m", "w1") is not None
    monkeypatch.setenv(CRASH_DIR_ENV, str(crash_dir))
    write_report([f"{job_id}-1-0"], error)  # as the engine writes it when the step raises
    stopped: list[bool] = []
    health = EngineHealth(sessions, None, "w1", "m", crash_dir, stop=lambda: stopped.append(True), restart=restart)  # type: ignore[arg-type]
    asyncio.run(health.engine_died())
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job, health, stopped


def test_a_host_problem_is_not_held_against_the_job(
    any_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the engine user may not read is the host's set-up: not an EngineCrash (which the crash cool-down
    counts against the job's key), and the message says whose problem it is."""
    job, _, stopped = crash_alone(
        any_database, tmp_path, PermissionError(13, "Permission denied", "/root/.pyenv"), monkeypatch
    )
    assert stopped == [True]  # no fresh engine to start: the worker stops
    assert job.status is JobStatus.FAILED and job.error_type == "EngineHostError", job.error_type
    assert "host's set-up, not in this job's code" in (job.error_message or "")


def test_an_error_of_the_engine_on_the_jobs_input_is_an_engine_crash(
    any_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, _, _ = crash_alone(any_database, tmp_path, RuntimeError("shape mismatch in the forward"), monkeypatch)
    assert job.status is JobStatus.FAILED and job.error_type == "EngineCrash", job.error_type
    assert "shape mismatch" in (job.error_message or "")


def test_a_fresh_engine_serves_once_the_jobs_are_settled_and_a_late_death_of_the_old_one_changes_nothing(
    any_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = session_factory(make_engine(any_database))
    started: list[JobStatus] = []

    async def restart(why: str) -> None:  # the worker's EngineRestart; a real one: tests/workers/test_engine_restart.py
        with sessions() as session:
            started.extend(session.scalars(select(Job.status)))  # the dead engine's jobs are settled first

    job, health, stopped = crash_alone(any_database, tmp_path, RuntimeError("boom"), monkeypatch, restart)
    assert job.status is JobStatus.FAILED and started == [JobStatus.FAILED]
    assert stopped == [] and not health.dead.is_set() and health.generation == 1

    async def later() -> bool:
        await health.engine_died(generation=0)  # a job of the dead engine that saw its death only now
        return await health.restarted()

    assert asyncio.run(later()) is True
    assert started == [JobStatus.FAILED] and stopped == [] and health.generation == 1  # nothing started again


def test_a_worker_whose_fresh_engine_does_not_start_stops_and_hands_its_work_back(
    any_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def restart(why: str) -> None:
        raise RuntimeError("no memory for a second engine")

    _, health, stopped = crash_alone(any_database, tmp_path, RuntimeError("boom"), monkeypatch, restart)
    assert stopped == [True] and health.dead.is_set()
    assert asyncio.run(health.restarted()) is False  # a token that comes now is handed back


def test_a_replaced_engine_sends_every_job_back_as_it_was_and_blames_none(
    services: Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trust-domain switch with NNQUEUE_DOMAIN_SWITCH=restart (EngineHealth.replace): whatever crash report lies
    around is not read, no job fails or counts a crash, every held job is QUEUED again saying why, and the fresh engine
    is the next generation; a worker with no in-place restart replaces nothing."""
    model_key = f"m-{uuid.uuid4().hex[:8]}"
    jobs = [queue_job(services.sessions, model_key) for _ in range(2)]
    for _ in jobs:
        assert claim_next_job(services.sessions, model_key, "w1") is not None
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path))
    write_report([f"{jobs[0]}-1-0"], RuntimeError("an earlier step's report"))

    def health(restart: Callable[[], Awaitable[None]] | None) -> EngineHealth:
        return EngineHealth(services.sessions, services.celery, "w1", model_key, tmp_path, restart=restart)

    assert asyncio.run(health(None).replace("a switch")) is False
    statuses = [services.job(job_id).status for job_id in jobs]
    assert statuses == [JobStatus.RUNNING] * 2  # nothing was settled

    async def restart(why: str) -> None:
        return None

    replacing = health(restart)
    assert asyncio.run(replacing.replace("a switch from trust domain 'a' to 'b'")) is True
    assert replacing.generation == 1 and not replacing.dead.is_set()
    for job_id in jobs:
        job = services.job(job_id)
        assert job.status is JobStatus.QUEUED and "engine_crashes" not in (job.meta or {}), (job.status, job.meta)
    with services.sessions() as session:
        reasons = session.scalars(
            select(JobEvent.detail).where(JobEvent.job_id.in_(jobs), JobEvent.to_status == JobStatus.QUEUED)
        ).all()
    said = "its engine was replaced: a switch from trust domain 'a' to 'b'"
    assert sum(said in detail.get("reason", "") for detail in reasons) == 2, reasons


def test_a_replacement_keeps_the_jobs_it_was_made_for(services: Services, tmp_path: Path) -> None:
    """A switch's replacement keeps the new domain's traces that waited for it: handed back with the rest, the next
    claim could take the old domain's again and switch back (a fifth red-team round: 31 replacements in 4 minutes,
    neither owner's job ever ran)."""
    model_key = f"m-{uuid.uuid4().hex[:8]}"
    waiting, other = (queue_job(services.sessions, model_key) for _ in range(2))
    for _ in range(2):
        assert claim_next_job(services.sessions, model_key, "w1") is not None

    async def restart(why: str) -> None:
        return None

    health = EngineHealth(services.sessions, services.celery, "w1", model_key, tmp_path, restart=restart)
    assert asyncio.run(health.replace("a switch from trust domain 'a' to 'b'", keep=frozenset({waiting}))) is True
    assert services.job(waiting).status is JobStatus.RUNNING
    assert services.job(other).status is JobStatus.QUEUED


def test_a_report_that_names_none_of_the_running_traces_is_read_as_no_report(
    any_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace can crash the engine at will with a report naming another job (a fifth red-team round named a queued
    one of another owner's): its own job went back to the queue unblamed, every time. Read as no report, the trace
    runs again alone, charged the crash."""
    sessions = session_factory(make_engine(any_database))
    mallory, alice = queue_job(sessions, "m", owner="mallory"), queue_job(sessions, "m")
    assert claim_next_job(sessions, "m", "w1") is not None  # mallory's: alice's waits in the queue
    monkeypatch.setenv(CRASH_DIR_ENV, str(tmp_path))
    write_report([f"{alice}-1-0"], RuntimeError("a forged report"))
    health = EngineHealth(sessions, None, "w1", "m", tmp_path, stop=lambda: None)  # type: ignore[arg-type]
    asyncio.run(health.engine_died())
    with sessions() as session:
        hers, other = session.get(Job, mallory), session.get(Job, alice)
        assert hers is not None and other is not None
        assert hers.status is JobStatus.QUEUED and (hers.meta or {}).get("engine_crashes") == 1, hers.meta
        assert (hers.meta or {}).get("run_alone") is True
        assert other.status is JobStatus.QUEUED and "engine_crashes" not in (other.meta or {})
