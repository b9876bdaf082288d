"""``submit_job`` admits a job only for a model that a live worker serves and while the key has room, for every
submitter (not only the API), and a refused job leaves nothing behind."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select

from nnqueue.broker import create_celery_app
from nnqueue.db.lifecycle import transition
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler import registry
from nnqueue.scheduler.admission import AdmissionPolicy, ModelNotServed, TooManyJobsInFlight
from nnqueue.scheduler.submission import submit_job
from nnqueue.settings import Settings
from nnqueue.storage.local import LocalObjectStore


def test_submit_job_refuses_an_unserved_model_and_a_full_key_storing_nothing(
    database_factory: Callable[..., str], redis_url: str, tmp_path: Path
) -> None:
    sessions = session_factory(make_engine(database_factory()))
    store = LocalObjectStore(tmp_path)
    app = create_celery_app(Settings(_env_file=None, broker_url=redis_url))
    policy = AdmissionPolicy(stale_after_s=30, max_jobs_in_flight_per_key=2)
    model = f"m-{uuid.uuid4().hex[:8]}"
    registry.register(sessions, registry.new_worker_id(), model, "q", 1)

    def submit(model_key: str = model) -> Job:
        return submit_job(
            sessions, store, app, admission=policy, owner="alice", model_key=model_key, payload=b"t", api_key_id=7
        )

    with pytest.raises(ModelNotServed, match=f"no live worker serves model 'gpt-nobody'; live models: '{model}'"):
        submit("gpt-nobody")
    first, _ = submit(), submit()
    with pytest.raises(TooManyJobsInFlight, match="already has 2 jobs queued or running; the limit is 2"):
        submit()
    with transaction(sessions) as session:  # an ended job frees its place
        transition(session, first.id, JobStatus.CANCELLED)
    submit()
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 3
    assert len(list((tmp_path / "payloads").iterdir())) == 3  # the refused ones stored no payload
