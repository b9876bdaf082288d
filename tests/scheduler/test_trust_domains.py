"""Trust domains (nnqueue.scheduler.trust_domains) on real Postgres and SQLite: a job records its owner's domain when
accepted (their own by default, the group an admin put them in, or the deployment's); moving an owner moves their
queued jobs, not their running ones; names and owners are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.api import auth
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler import registry
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.scheduler.submission import accept_job
from nnqueue.scheduler.trust_domains import (
    InvalidDomain,
    Mode,
    UnknownOwner,
    domain_of,
    groups,
    join_group,
    leave_group,
)
from nnqueue.storage.local import LocalObjectStore

MODEL = "m"


@pytest.fixture
def sessions(any_database: str) -> sessionmaker[Session]:
    sessions = session_factory(make_engine(any_database))
    registry.register(sessions, registry.new_worker_id(), MODEL, "q", 1)
    with transaction(sessions) as session:
        for owner in ("alice", "bob", "carol"):
            auth.create_key(session, owner, ["trace"])
    return sessions


def accept(sessions: sessionmaker[Session], tmp_path: Path, owner: str, mode: Mode = "owner") -> Job:
    with transaction(sessions) as session:
        policy = AdmissionPolicy(stale_after_s=30, max_jobs_in_flight_per_key=100, trust_domains=mode)
        return accept_job(
            session, LocalObjectStore(tmp_path), admission=policy, owner=owner, model_key=MODEL, payload=b"p"
        ).job


def stored_domains(sessions: sessionmaker[Session]) -> dict[str, list[str]]:
    with sessions() as session:
        rows = session.execute(select(Job.owner, Job.domain, Job.status).order_by(Job.created_at))
        found: dict[str, list[str]] = {}
        for owner, domain, status in rows:
            found.setdefault(owner, []).append(f"{domain} {status.value}")
        return found


def test_a_job_records_its_owners_domain_as_it_is_accepted(sessions: sessionmaker[Session], tmp_path: Path) -> None:
    assert accept(sessions, tmp_path, "alice").domain == "owner:alice"  # alone: the shipped default
    with transaction(sessions) as session:
        assert join_group(session, "alice", "lab", "owner") == 1  # her queued job moves with her
        assert join_group(session, "bob", "lab", "owner") == 0
    assert [accept(sessions, tmp_path, owner).domain for owner in ("alice", "bob", "carol")] == [
        "lab",
        "lab",
        "owner:carol",
    ]
    # The whole deployment as one domain: groups do not matter.
    assert {accept(sessions, tmp_path, owner, "deployment").domain for owner in ("alice", "carol")} == {"deployment"}
    with sessions() as session:
        assert (domain_of(session, "bob", "owner"), domain_of(session, "bob", "deployment")) == ("lab", "deployment")
        assert groups(session) == {"lab": ["alice", "bob"]} and groups(session, "bob") == {"lab": ["alice", "bob"]}
        assert groups(session, "carol") == {}


def test_moving_an_owner_moves_their_queued_jobs_not_their_running_ones(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    running, queued = accept(sessions, tmp_path, "alice"), accept(sessions, tmp_path, "alice")
    accept(sessions, tmp_path, "bob")
    with transaction(sessions) as session:
        session.execute(update(Job).where(Job.id == running.id).values(status=JobStatus.RUNNING))
    with transaction(sessions) as session:
        assert join_group(session, "alice", "lab", "owner") == 1
    assert stored_domains(sessions) == {
        "alice": ["owner:alice running", "lab queued"],
        "bob": ["owner:bob queued"],
    }
    with transaction(sessions) as session:
        assert join_group(session, "alice", "team-b", "owner") == 1  # from one group to another
        assert leave_group(session, "alice", "owner") == 1
    assert stored_domains(sessions)["alice"] == ["owner:alice running", "owner:alice queued"]
    with sessions() as session:
        assert groups(session) == {}


def test_group_names_and_owners_are_checked(sessions: sessionmaker[Session]) -> None:
    with transaction(sessions) as session:
        for name in ("deployment", "other", "owner:bob", "", "-lab", "a b", "x" * 65):
            with pytest.raises(InvalidDomain):
                join_group(session, "alice", name, "owner")
        with pytest.raises(UnknownOwner, match="no API key has owner 'alicee'"):
            join_group(session, "alicee", "lab", "owner")
        with pytest.raises(UnknownOwner):
            leave_group(session, "nobody", "owner")
        assert groups(session) == {}
