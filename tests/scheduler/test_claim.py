"""Tokens claim the best queued work from the database, on real Postgres and on SQLite: one owner's jobs by
priority, then age; owners' jobs in turns, counting what each runs (and queue positions say the same); the traces
of one trust domain per claim, and none of another while the worker's domain has traces in flight; harvest chunks
fairly across owners; concurrent claims never take one unit twice."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import ApiKey, Harvest, HarvestChunk, Job, JobKind, JobStatus, utcnow
from nnqueue.db.session import make_engine, session_factory, transaction
from nnqueue.scheduler.claim import claim_jobs, claim_next_chunk
from nnqueue.scheduler.domain_turns import DomainTurns
from nnqueue.scheduler.positions import queue_positions
from nnqueue.scheduler.trust_domains import join_group
from tests.utils.queued import add_harvest, claim_next_job, queue_job

S = JobStatus
MODEL = "m"
LAB = "lab"  # a group everyone of a test is in, where only the order across owners is under test


@pytest.fixture
def sessions(any_database: str) -> sessionmaker[Session]:
    return session_factory(make_engine(any_database))


def test_the_highest_priority_job_runs_first_then_the_oldest(sessions: sessionmaker[Session]) -> None:
    low_old = queue_job(sessions, MODEL, 0)
    normal = queue_job(sessions, MODEL, 1)
    urgent_late = queue_job(sessions, MODEL, 5)
    low_new = queue_job(sessions, MODEL, 0)
    queue_job(sessions, "another model", 9)

    with sessions() as session:
        jobs = [session.get(Job, job_id) for job_id in (low_old, normal, urgent_late, low_new)]
        assert queue_positions(session, jobs) == {urgent_late: 1, normal: 2, low_old: 3, low_new: 4}
    claimed = [claim_next_job(sessions, MODEL, "w") for _ in range(5)]
    assert [job.id if job else None for job in claimed] == [urgent_late, normal, low_old, low_new, None]
    assert all(job.status is S.RUNNING and job.worker_id == "w" for job in claimed if job)


def test_jobs_queued_at_the_same_moment_stand_and_run_in_id_order(sessions: sessionmaker[Session]) -> None:
    ids = [queue_job(sessions, MODEL, 0) for _ in range(3)]
    with transaction(sessions) as session:
        moment = session.get(Job, ids[0]).queued_at  # type: ignore[union-attr]
        session.execute(update(Job).where(Job.id.in_(ids)).values(queued_at=moment))
    with sessions() as session:
        jobs = [session.get(Job, job_id) for job_id in ids]
        positions = queue_positions(session, jobs)  # type: ignore[arg-type]
    in_place_order = sorted(ids, key=lambda job_id: positions[job_id])
    assert sorted(positions.values()) == [1, 2, 3]
    assert [claim_next_job(sessions, MODEL, "w").id for _ in ids] == in_place_order  # type: ignore[union-attr]


def race(claim: Callable[[str], Any], workers: int = 8) -> list[Any]:
    """What ``workers`` threads claiming at once got (the claimed unit's id, or None)."""
    barrier = threading.Barrier(workers)
    claimed: list[Any] = []

    def take(worker: str) -> None:
        barrier.wait()
        unit = claim(worker)
        claimed.append(unit.id if unit else None)

    threads = [threading.Thread(target=take, args=(f"w{i}",)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return claimed


def test_concurrent_claims_take_each_job_once(sessions: sessionmaker[Session]) -> None:
    queued = {queue_job(sessions, MODEL) for _ in range(5)}
    claimed = race(lambda worker: claim_next_job(sessions, MODEL, worker))
    taken = [job_id for job_id in claimed if job_id is not None]
    assert sorted(taken) == sorted(queued) and claimed.count(None) == 3


def test_a_claim_for_several_tokens_takes_the_best_jobs_best_first(sessions: sessionmaker[Session]) -> None:
    low, high, middle, last = (queue_job(sessions, MODEL, priority) for priority in (0, 5, 1, 0))
    first = claim_jobs(sessions, MODEL, "w", 3)
    assert [job.id for job in first] == [high, middle, low]
    assert all(job.status is S.RUNNING and job.worker_id == "w" and job.attempts == 1 for job in first)
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 3)] == [last]  # fewer queued than asked
    assert claim_jobs(sessions, MODEL, "w", 3) == []


def test_concurrent_claims_of_several_jobs_take_each_job_once(sessions: sessionmaker[Session]) -> None:
    queued = {queue_job(sessions, MODEL) for _ in range(11)}
    taken: list[Any] = []
    race(lambda worker: taken.extend(job.id for job in claim_jobs(sessions, MODEL, worker, 2)))
    assert sorted(taken) == sorted(queued)


def test_owners_take_turns_so_a_flood_queued_first_does_not_go_first(sessions: sessionmaker[Session]) -> None:
    flood = [queue_job(sessions, MODEL, owner="alice", domain=LAB) for _ in range(5)]
    bob, carol = (queue_job(sessions, MODEL, owner=owner, domain=LAB) for owner in ("bob", "carol"))
    urgent = queue_job(sessions, MODEL, 5, owner="alice", domain=LAB)  # orders alice's own jobs only

    with sessions() as session:
        places = queue_positions(session, [session.get(Job, job_id) for job_id in [*flood, bob, carol, urgent]])  # type: ignore[misc]
    claimed = [claim_next_job(sessions, MODEL, "w") for _ in range(9)]
    order = [job.id if job else None for job in claimed]
    # Everyone's first job has turn 1 (alice's is her urgent one, which also wins the tie); then alice, with one
    # running, waits for bob's and carol's turns; first come, first served would have run her flood first.
    assert order == [urgent, bob, carol, *flood, None]
    assert [places[job_id] for job_id in order[:-1]] == list(range(1, 9))


def test_jobs_an_owner_runs_already_count_against_their_turn(sessions: sessionmaker[Session]) -> None:
    running = [queue_job(sessions, MODEL, owner="alice", domain=LAB) for _ in range(3)]
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 3)] == running
    older = queue_job(sessions, MODEL, owner="alice", domain=LAB)
    newer = queue_job(sessions, MODEL, owner="bob", domain=LAB)
    with sessions() as session:
        assert queue_positions(session, [session.get(Job, older), session.get(Job, newer)]) == {newer: 1, older: 2}  # type: ignore[list-item]
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 2)] == [newer, older]


def test_a_claim_for_several_tokens_interleaves_the_owners(sessions: sessionmaker[Session]) -> None:
    alice = [queue_job(sessions, MODEL, owner="alice", domain=LAB) for _ in range(4)]
    bob = [queue_job(sessions, MODEL, owner="bob", domain=LAB) for _ in range(2)]
    claimed = [job.id for job in claim_jobs(sessions, MODEL, "w", 5)]
    assert claimed == [alice[0], bob[0], alice[1], bob[1], alice[2]]


def test_a_claim_takes_the_traces_of_one_domain_and_steering_jobs_of_any(sessions: sessionmaker[Session]) -> None:
    alice = [queue_job(sessions, MODEL, owner="alice") for _ in range(2)]  # each owner alone: the default
    bob = [queue_job(sessions, MODEL, owner="bob") for _ in range(2)]
    steer = queue_job(sessions, MODEL, owner="bob", kind=JobKind.STEER)
    turns = DomainTurns()

    first = claim_jobs(sessions, MODEL, "w", 5, turns=turns)
    # The oldest trace's domain, and the steering job (no user code); none of bob's traces beside alice's.
    assert sorted(job.id for job in first) == sorted([*alice, steer])
    assert (turns.current, turns.in_flight) == ("owner:alice", 2)
    assert [(switch.previous, switch.domain) for switch in [turns.unverified()] if switch] == [(None, "owner:alice")]

    # Alice's traces in flight: bob's wait (a token that finds nothing waits for the turn to end).
    assert claim_jobs(sessions, MODEL, "w", 5, turns=turns) == []
    assert turns.others_wait()
    assert [turns.ended(alice[0]), turns.ended(alice[1])] == [False, True]
    second = claim_jobs(sessions, MODEL, "w", 5, turns=turns)
    assert sorted(job.id for job in second) == sorted(bob)
    switch = turns.unverified()
    assert switch is not None and (switch.previous, switch.domain) == ("owner:alice", "owner:bob")


def test_a_domain_keeps_the_engine_for_the_hold_once_others_wait(sessions: sessionmaker[Session]) -> None:
    now = [0.0]
    turns = DomainTurns(hold_s=10, clock=lambda: now[0])
    alice = [queue_job(sessions, MODEL, owner="alice") for _ in range(3)]
    bob = queue_job(sessions, MODEL, owner="bob")

    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 1, turns=turns)] == [alice[0]]  # bob waits from 0
    now[0] = 9.0  # within the hold: alice's next trace, though bob's waited longer
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 1, turns=turns)] == [alice[1]]
    now[0] = 10.0  # the hold is over: no more of alice's, and bob's only once hers have ended
    assert claim_jobs(sessions, MODEL, "w", 1, turns=turns) == []
    turns.ended(alice[0])
    assert claim_jobs(sessions, MODEL, "w", 1, turns=turns) == []
    turns.ended(alice[1])
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 2, turns=turns)] == [bob]
    turns.ended(bob)  # bob's turn ends with nobody else waiting but alice: hers again, without waiting for a hold
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 2, turns=turns)] == [alice[2]]


def test_a_worker_takes_traces_of_its_allowed_domains_only(sessions: sessionmaker[Session]) -> None:
    queue_job(sessions, MODEL, owner="alice")
    bobs = queue_job(sessions, MODEL, owner="bob")
    steer = queue_job(sessions, MODEL, owner="alice", kind=JobKind.STEER)
    turns = DomainTurns(allowed=frozenset({"owner:bob"}))
    assert sorted(job.id for job in claim_jobs(sessions, MODEL, "w", 5, turns=turns)) == sorted([bobs, steer])
    turns.ended(bobs)
    assert claim_jobs(sessions, MODEL, "w", 5, turns=turns) == []  # alice's trace stays queued
    assert not turns.others_wait()


def test_with_all_work_another_domains_steering_and_chunks_wait_for_a_fresh_engine(
    sessions: sessionmaker[Session],
) -> None:
    # NNQUEUE_DOMAIN_SWITCH=restart: alice's steering job and chunk never run on the engine mallory's trace ran on
    # (a fifth red-team round's escaped trace read and forged a steering job beside it).
    now = [0.0]
    turns = DomainTurns(hold_s=10, clock=lambda: now[0], all_work=True)
    mallory = queue_job(sessions, MODEL, owner="mallory")
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 4, turns=turns)] == [mallory]
    turns.verified(turns.unverified())  # type: ignore[arg-type]
    steer = queue_job(sessions, MODEL, owner="alice", kind=JobKind.STEER)
    (chunk,) = add_harvest(sessions, MODEL, "alice", 1)
    assert claim_jobs(sessions, MODEL, "w", 4, turns=turns) == []
    assert claim_next_chunk(sessions, MODEL, "w", turns=turns) is None
    assert turns.others_wait()
    now[0] = 10  # the hold is over; mallory's trace still runs
    assert claim_next_chunk(sessions, MODEL, "w", turns=turns) is None
    turns.ended(mallory)
    claimed = claim_next_chunk(sessions, MODEL, "w", turns=turns)
    assert claimed is not None and claimed.id == chunk
    switch = turns.unverified()
    assert switch is not None and (switch.previous, switch.domain) == ("owner:mallory", "owner:alice")
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 4, turns=turns)] == [steer]


def test_with_all_work_an_engine_that_ran_no_trace_takes_every_domains_work(sessions: sessionmaker[Session]) -> None:
    turns = DomainTurns(all_work=True)
    chunks = add_harvest(sessions, MODEL, "alice", 1) + add_harvest(sessions, MODEL, "bob", 1)
    steer = queue_job(sessions, MODEL, owner="carol", kind=JobKind.STEER)
    taken = [claim_next_chunk(sessions, MODEL, "w", turns=turns) for _ in chunks]
    assert sorted(chunk.id for chunk in taken if chunk) == sorted(chunks)
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 4, turns=turns)] == [steer]
    assert turns.current is None and turns.unverified() is None
    # Dave's trace waits: his turn drains the others' work first.
    trace = queue_job(sessions, MODEL, owner="dave")
    assert claim_jobs(sessions, MODEL, "w", 4, turns=turns) == [] and turns.others_wait()
    for unit in [("chunk", chunks[0]), ("chunk", chunks[1]), steer]:
        turns.ended(unit)
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 4, turns=turns)] == [trace]
    switch = turns.unverified()  # their prompts were on this engine: dave's trace runs on a fresh one
    assert switch is not None and switch.previous == "owner:alice, owner:bob, owner:carol"


def test_with_all_work_a_groups_chunks_run_in_its_turn(sessions: sessionmaker[Session]) -> None:
    with transaction(sessions) as session:
        session.add(ApiKey(key_hash="h" * 64, key_prefix="p", owner="bob", created_at=utcnow()))
        session.flush()
        join_group(session, "bob", LAB, "owner")
    turns = DomainTurns(all_work=True)
    alice = queue_job(sessions, MODEL, owner="alice", domain=LAB)
    assert [job.id for job in claim_jobs(sessions, MODEL, "w", 1, turns=turns)] == [alice]
    (chunk,) = add_harvest(sessions, MODEL, "bob", 1)  # bob is in alice's group: no switch
    claimed = claim_next_chunk(sessions, MODEL, "w", turns=turns)
    assert claimed is not None and claimed.id == chunk and turns.in_flight == 2


def test_chunks_are_claimed_fairly_across_owners(sessions: sessionmaker[Session]) -> None:
    alice = add_harvest(sessions, MODEL, "alice", 4)
    bob = add_harvest(sessions, MODEL, "bob", 2)  # queued after all of alice's
    carol_urgent = add_harvest(sessions, MODEL, "carol", 1, priority=3)

    order = []
    for _ in range(7):
        chunk = claim_next_chunk(sessions, MODEL, "w")
        assert chunk is not None
        order.append((chunk.owner, chunk.index))
    # Nobody runs anything yet: carol's priority wins. Then the owner with fewer running chunks goes next
    # (ties: the older chunk), so bob's chunks, queued after all of alice's, do not wait behind them.
    assert order == [
        ("carol", 0),
        ("alice", 0),
        ("bob", 0),
        ("alice", 1),
        ("bob", 1),
        ("alice", 2),
        ("alice", 3),
    ]
    assert claim_next_chunk(sessions, MODEL, "w") is None
    assert len(alice) == 4 and len(bob) == 2 and len(carol_urgent) == 1
    with sessions() as session:
        assert {harvest.status for harvest in session.query(Harvest)} == {S.RUNNING}


def test_a_finished_chunk_frees_its_owners_turn(sessions: sessionmaker[Session]) -> None:
    add_harvest(sessions, MODEL, "alice", 3)
    add_harvest(sessions, MODEL, "bob", 3)
    first = claim_next_chunk(sessions, MODEL, "w")  # alice: 1 running
    second = claim_next_chunk(sessions, MODEL, "w")  # bob: 1 running
    assert first is not None and second is not None and (first.owner, second.owner) == ("alice", "bob")
    with transaction(sessions) as session:  # bob's chunk completes: bob has fewer running now
        session.execute(update(HarvestChunk).where(HarvestChunk.id == second.id).values(status=S.COMPLETED))
    third = claim_next_chunk(sessions, MODEL, "w")
    assert third is not None and (third.owner, third.index) == ("bob", 1)


def test_concurrent_chunk_claims_take_each_chunk_once(sessions: sessionmaker[Session]) -> None:
    chunks = set(add_harvest(sessions, MODEL, "alice", 4) + add_harvest(sessions, MODEL, "bob", 2))
    claimed = race(lambda worker: claim_next_chunk(sessions, MODEL, worker))
    assert sorted(c for c in claimed if c is not None) == sorted(chunks) and claimed.count(None) == 2
