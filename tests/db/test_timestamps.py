"""Every timestamp column reads back as an aware UTC datetime, on Postgres and on SQLite (which keeps no zone).

The conversion is the column type's (``nnqueue.db.models.UTCDateTime``), so ORM rows, aggregates over a
timestamp column and comparisons with an aware moment in another zone all agree, on both databases.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import create_job
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction

# Ten in the morning in Paris in winter is nine o'clock UTC.
PARIS_WINTER = timezone(timedelta(hours=1))


@pytest.fixture
def sessions(any_database: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(any_database)
    yield session_factory(engine)
    engine.dispose()


def test_timestamps_read_back_as_aware_utc(sessions: sessionmaker[Session]) -> None:
    queued = datetime(2026, 1, 5, 10, 0, 0, 123456, tzinfo=PARIS_WINTER)
    with transaction(sessions) as session:
        job = create_job(
            session, Job(owner="alice", model_key="tiny", kind=JobKind.TRACE, payload_key="p", payload_size=1)
        )
        job.queued_at = queued
        job_id = job.id
    with sessions() as session:
        stored = session.get_one(Job, job_id)
        assert stored.queued_at == queued and stored.queued_at.tzinfo is UTC
        assert stored.queued_at.hour == 9 and stored.created_at.tzinfo is UTC
        oldest = session.scalar(select(func.min(Job.queued_at)).where(Job.status == JobStatus.QUEUED))
        assert oldest == queued and oldest is not None and oldest.tzinfo is UTC
        # A comparison bound in another zone means the same moment.
        assert session.scalar(select(func.count()).where(Job.queued_at < queued + timedelta(seconds=1))) == 1
        assert session.scalar(select(func.count()).where(Job.queued_at > queued.astimezone(UTC))) == 0
