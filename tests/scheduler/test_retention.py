"""Retention deletes the payloads and results of jobs that ended long enough ago, marks their rows, keeps the
rest; ``nnqueue gc`` runs it with NNQUEUE_RETENTION_DAYS (on real Postgres and on SQLite)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.db.lifecycle import create_job, transition
from nnqueue.db.models import Job, JobKind, JobPayload, JobStatus, utcnow
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler.payloads import keep_inline
from nnqueue.scheduler.retention import purge_expired
from nnqueue.storage.keys import SAFETENSORS_FILE, payload_key, result_key
from nnqueue.storage.local import LocalObjectStore
from tests.utils.results import store_result

S = JobStatus


def add_job(sessions: sessionmaker[Session], store: LocalObjectStore, ended: S | None, days_ago: float) -> uuid.UUID:
    """A job with its payload stored, ended with ``ended`` (and a result when completed) ``days_ago`` days ago."""
    import torch

    job_id = uuid.uuid4()
    store.put_bytes(payload_key(job_id), b"trace")
    with transaction(sessions) as session:
        job = Job(
            id=job_id, owner="a", model_key="m", kind=JobKind.TRACE, payload_key=payload_key(job_id), payload_size=5
        )
        create_job(session, job)
    if ended is None:
        return job_id
    with transaction(sessions) as session:
        transition(session, job_id, S.RUNNING, worker_id="w")
    fields = {}
    if ended is S.COMPLETED:
        stored = store_result(store, job_id, {"x": torch.ones(2)})
        fields = {"result_key": stored.key, "result_size": stored.size, "result_format": stored.format}
    with transaction(sessions) as session:
        transition(session, job_id, ended, **fields)
        session.execute(update(Job).where(Job.id == job_id).values(finished_at=utcnow() - timedelta(days=days_ago)))
    return job_id


def objects(store: LocalObjectStore, job_id: uuid.UUID) -> list[bool]:
    keys = (payload_key(job_id), result_key(job_id, "saves.pt", 1), result_key(job_id, SAFETENSORS_FILE, 1))
    return [store.exists(key) for key in keys]


def test_ended_jobs_older_than_the_retention_lose_their_objects_and_keep_their_rows(
    any_database: str, tmp_path: Path
) -> None:
    sessions = session_factory(make_engine(any_database))
    store = LocalObjectStore(tmp_path / "objects")
    old = {status: add_job(sessions, store, status, days_ago=10) for status in (S.COMPLETED, S.FAILED, S.CANCELLED)}
    recent = add_job(sessions, store, S.COMPLETED, days_ago=1)
    queued = add_job(sessions, store, None, days_ago=0)

    assert purge_expired(sessions, store, timedelta(days=7), dry_run=True).jobs == 3
    assert objects(store, old[S.COMPLETED]) == [True, True, True]  # a dry run deletes nothing

    # Whatever else the job's attempts left in its results folder goes too (found by listing it).
    left_behind = result_key(old[S.FAILED], "saves.pt", 9)
    store.put_bytes(left_behind, b"an attempt's partial result")

    report = purge_expired(sessions, store, timedelta(days=7), batch_size=2)  # two batches
    assert report.jobs == 3
    for job_id in old.values():
        assert objects(store, job_id) == [False, False, False]
    assert not store.exists(left_behind)
    assert objects(store, recent) == [True, True, True] and objects(store, queued) == [True, False, False]
    with sessions() as session:
        rows = {job_id: session.get(Job, job_id) for job_id in [*old.values(), recent, queued]}
    assert all(rows[job_id].purged_at is not None for job_id in old.values())
    assert rows[recent].purged_at is None and rows[queued].purged_at is None
    assert rows[old[S.COMPLETED]].status is S.COMPLETED and rows[old[S.COMPLETED]].result_size  # history stays
    assert purge_expired(sessions, store, timedelta(days=7)).jobs == 0  # nothing twice


def test_a_payload_kept_in_the_database_is_deleted_with_the_objects(any_database: str, tmp_path: Path) -> None:
    sessions = session_factory(make_engine(any_database))
    store = LocalObjectStore(tmp_path / "objects")
    old, recent = (add_job(sessions, store, S.FAILED, days_ago=days) for days in (10, 1))
    with transaction(sessions) as session:  # as the API keeps a small payload: in job_payloads, no key
        for job_id in (old, recent):
            session.execute(update(Job).where(Job.id == job_id).values(payload_key=None))
            keep_inline(session, job_id, b"trace")

    assert purge_expired(sessions, store, timedelta(days=7)).jobs == 1
    with sessions() as session:
        assert session.get(JobPayload, old) is None and session.get(Job, old).purged_at is not None
        assert session.get(JobPayload, recent) is not None


def test_gc_runs_retention_from_the_settings(
    database_factory: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = database_factory()
    sessions = session_factory(make_engine(url))
    store = LocalObjectStore(tmp_path / "objects")
    expired = add_job(sessions, store, S.FAILED, days_ago=3)
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", url)
    monkeypatch.setenv("NNQUEUE_STORE_DIR", str(store.root))
    runner = CliRunner()

    kept = runner.invoke(app, ["gc"], env={"COLUMNS": "200"})
    assert kept.exit_code == 0 and "NNQUEUE_RETENTION_DAYS is not set" in kept.output
    monkeypatch.setenv("NNQUEUE_RETENTION_DAYS", "2")
    dry = runner.invoke(app, ["gc", "--dry-run"], env={"COLUMNS": "200"})
    assert dry.exit_code == 0 and "would purge the payloads and results of 1 jobs" in dry.output
    assert store.exists(payload_key(expired))
    purged = runner.invoke(app, ["gc"], env={"COLUMNS": "200"})
    assert purged.exit_code == 0 and "purged the payloads and results of 1 jobs" in purged.output, purged.output
    assert not store.exists(payload_key(expired))
    longer = runner.invoke(app, ["gc", "--older-than-days", "30"], env={"COLUMNS": "200"})
    assert "of 0 jobs" in longer.output
