"""``accept_job`` adds a job, its first event and its payload, checks the key's limit and reads the job's queue place
back, on real Postgres (one statement, :mod:`nnqueue.scheduler.intake`) and on SQLite (step by step): the same
rows, places and refusals on both."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import Job, JobEvent, JobPayload, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler import registry
from nnqueue.scheduler.admission import AdmissionPolicy, TooManyJobsInFlight
from nnqueue.scheduler.payloads import load_payload
from nnqueue.scheduler.positions import queue_positions
from nnqueue.scheduler.submission import Accepted, accept_job
from nnqueue.storage.local import LocalObjectStore

MODEL = "m"
INLINE_MAX = 16


@pytest.fixture
def sessions(any_database: str) -> sessionmaker[Session]:
    sessions = session_factory(make_engine(any_database))
    registry.register(sessions, registry.new_worker_id(), MODEL, "q", 1)
    return sessions


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def _accept(
    sessions: sessionmaker[Session],
    store: LocalObjectStore,
    *,
    priority: int = 0,
    payload: bytes = b"small",
    api_key_id: int | None = 1,
    limit: int = 100,
    owner: str = "alice",
) -> Accepted:
    with transaction(sessions) as session:
        return accept_job(
            session,
            store,
            admission=AdmissionPolicy(stale_after_s=30, max_jobs_in_flight_per_key=limit),
            inline_payload_max_bytes=INLINE_MAX,
            owner=owner,
            model_key=MODEL,
            payload=payload,
            priority=priority,
            timeout_s=42.0,
            meta={"metadata": {"k": [1, "v"]}},
            api_key_id=api_key_id,
        )


def _counts(sessions: sessionmaker[Session]) -> tuple[int, int, int]:
    with sessions() as session:
        return tuple(  # type: ignore[return-value]
            session.scalar(select(func.count()).select_from(table)) for table in (Job, JobEvent, JobPayload)
        )


def test_an_accepted_job_is_stored_as_returned_with_its_event_and_payload(
    sessions: sessionmaker[Session], store: LocalObjectStore
) -> None:
    small, large = _accept(sessions, store, payload=b"small"), _accept(sessions, store, payload=b"L" * (INLINE_MAX + 1))
    columns = (
        "owner",
        "domain",
        "api_key_id",
        "model_key",
        "kind",
        "status",
        "priority",
        "timeout_s",
        "meta",
        "payload_key",
    )
    columns += ("payload_size", "attempts", "progress_done", "worker_id", "started_at", "finished_at")
    with sessions() as session:
        for accepted, payload in ((small, b"small"), (large, b"L" * (INLINE_MAX + 1))):
            stored = session.get(Job, accepted.job.id)
            assert (
                stored is not None
                and stored.status is JobStatus.QUEUED
                and stored.meta == {"metadata": {"k": [1, "v"]}}
            )
            assert {c: getattr(stored, c) for c in columns} == {c: getattr(accepted.job, c) for c in columns}
            for moment in ("created_at", "queued_at"):  # SQLite gives them back without their zone
                assert getattr(stored, moment).replace(tzinfo=None) == getattr(accepted.job, moment).replace(
                    tzinfo=None
                )
            [event] = session.scalars(select(JobEvent).where(JobEvent.job_id == stored.id))
            assert (event.from_status, event.to_status, event.detail) == (
                None,
                JobStatus.QUEUED,
                {"payload_bytes": len(payload)},
            )
            assert load_payload(sessions, store, stored) == payload
        assert session.get(JobPayload, small.job.id) is not None and session.get(JobPayload, large.job.id) is None
    assert small.job.payload_key is None and large.job.payload_key is not None and store.exists(large.job.payload_key)


def test_the_place_read_back_is_the_place_among_queued_jobs_by_priority_then_age(
    sessions: sessionmaker[Session], store: LocalObjectStore
) -> None:
    running = _accept(sessions, store, priority=9).job.id
    with transaction(sessions) as session:  # a running job stands in no queue
        session.execute(update(Job).where(Job.id == running).values(status=JobStatus.RUNNING))
    places = [_accept(sessions, store, priority=priority).queue_position for priority in (0, 5, 0, 5, 9, 1)]
    assert places == [1, 1, 3, 2, 1, 4]

    late = _accept(sessions, store, priority=1)
    with sessions() as session:
        assert queue_positions(session, [late.job]) == {late.job.id: late.queue_position} and late.queue_position == 5


def test_the_place_read_back_is_the_place_in_the_fair_order_across_owners(
    sessions: sessionmaker[Session], store: LocalObjectStore
) -> None:
    flood = [_accept(sessions, store).queue_position for _ in range(3)]
    bob = _accept(sessions, store, owner="bob")
    urgent = _accept(sessions, store, owner="carol", priority=5)
    # bob's first job goes after alice's first (both have turn 1; hers is older), not after all three of hers;
    # carol's, urgent, before both.
    assert flood == [1, 2, 3] and (bob.queue_position, urgent.queue_position) == (2, 1)
    with sessions() as session:
        jobs = list(session.scalars(select(Job).where(Job.status == JobStatus.QUEUED)))
        places = queue_positions(session, jobs)
    assert sorted(places.values()) == [1, 2, 3, 4, 5]
    assert (places[bob.job.id], places[urgent.job.id]) == (3, 1)  # alice's first is second now


def test_a_key_at_its_limit_is_refused_and_nothing_is_added_or_stored(
    sessions: sessionmaker[Session], store: LocalObjectStore
) -> None:
    first = _accept(sessions, store, limit=2)
    _accept(sessions, store, limit=2)
    before = _counts(sessions)
    for payload in (b"small", b"L" * (INLINE_MAX + 1)):
        with pytest.raises(TooManyJobsInFlight, match="already has 2 jobs queued or running; the limit is 2"):
            _accept(sessions, store, payload=payload, limit=2)
    assert _counts(sessions) == before
    assert not (store.root / "payloads").exists()

    _accept(sessions, store, api_key_id=None, limit=2)  # jobs without a key are not limited
    _accept(sessions, store, api_key_id=2, limit=2)  # nor are other keys' jobs counted
    with transaction(sessions) as session:  # an ended job frees its place
        session.execute(update(Job).where(Job.id == first.job.id).values(status=JobStatus.CANCELLED))
    _accept(sessions, store, limit=2)
    assert _counts(sessions)[0] == before[0] + 3


def test_a_job_id_given_by_the_submitter_is_kept(sessions: sessionmaker[Session], store: LocalObjectStore) -> None:
    job_id = uuid.uuid4()
    with transaction(sessions) as session:
        accepted = accept_job(
            session,
            store,
            admission=AdmissionPolicy(stale_after_s=30, max_jobs_in_flight_per_key=1),
            owner="bob",
            model_key=MODEL,
            payload=b"p",
            job_id=job_id,
        )
    with sessions() as session:
        stored = session.get(Job, job_id)
    assert accepted.job.id == job_id and stored is not None and stored.owner == "bob"
    assert stored.api_key_id is None and stored.timeout_s == 600.0 and stored.priority == 0
