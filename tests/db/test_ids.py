"""Ids by their first characters (:mod:`nnqueue.db.ids`) on both databases: Postgres' ``uuid`` and SQLite's hex text
order the same way, so one range on the primary key selects exactly the ids that start with the prefix."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from nnqueue.db.ids import id_range, starting_with
from nnqueue.db.lifecycle import create_job
from nnqueue.db.models import Job, JobKind
from nnqueue.db.session import make_engine, session_factory, transaction

IDS = [
    "aaaa0000-0000-4000-8000-000000000000",
    "aaaa1111-1111-4111-8111-111111111111",
    "abcdef00-0000-4000-8000-000000000000",
    "ffffffff-ffff-4fff-bfff-ffffffffffff",
    "00000000-0000-4000-8000-000000000001",
]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("aaaa", IDS[:2]),
        ("aaaa0", IDS[:1]),
        ("AAAA1111-1", IDS[1:2]),  # any case; dashes where the id has them
        ("aaaa-1", IDS[1:2]),  # or anywhere
        ("a", IDS[:3]),
        ("ffffffff-ffff-4fff-bfff-ffffffffffff", IDS[3:4]),  # a whole id
        ("0000", IDS[4:]),
        ("1", []),
    ],
)
def test_a_prefix_selects_exactly_the_ids_that_start_with_it(
    any_database: str, prefix: str, expected: list[str]
) -> None:
    engine = make_engine(any_database)
    sessions = session_factory(engine)
    try:
        with transaction(sessions) as session:
            for ident in IDS:
                job = Job(
                    id=uuid.UUID(ident),
                    owner="alice",
                    model_key="m",
                    kind=JobKind.TRACE,
                    priority=0,
                    meta={},
                    payload_key="p",
                    payload_size=1,
                )
                create_job(session, job)
        with sessions() as session:
            found = session.scalars(select(Job.id).where(starting_with(Job.id, prefix)).order_by(Job.id))
            assert sorted(str(ident) for ident in found) == sorted(expected)
    finally:
        engine.dispose()


@pytest.mark.parametrize("prefix", ["", "xyz", "a" * 33, "aaaa 1", "ü"])
def test_what_is_not_the_start_of_an_id_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="is not the start of an id"):
        id_range(prefix)
