"""DomainTurns (nnqueue.scheduler.domain_turns) on its own, with a clock the test moves: waiting domains take turns
round robin (the one served longest ago first), a switch waits for the turn's traces to end and for its
verification, and the hold bounds a turn only while others wait. The claim's use of it is tested on real databases
in test_claim.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from nnqueue.scheduler.domain_turns import DomainTurns, Grant

T0 = datetime(2026, 11, 28, tzinfo=UTC)


def waiting(*domains: str) -> dict[str, datetime]:
    """``domains`` waiting, the first one longest."""
    return {domain: T0 + timedelta(seconds=index) for index, domain in enumerate(domains)}


def run_turn(turns: DomainTurns, domain: str) -> None:
    """One trace of ``domain`` claimed and ended."""
    turns.claimed(Grant(domain), ["t"])
    assert turns.ended("t")


def traces_of(turns: DomainTurns, *domains: str) -> str | None:
    """The domain whose traces a claim may take, ``domains`` waiting (the first one longest)."""
    return turns.choose(waiting(*domains)).traces


def test_waiting_domains_take_turns_round_robin() -> None:
    now = [0.0]
    turns = DomainTurns(hold_s=1, clock=lambda: now[0])
    served = []
    for _ in range(6):
        now[0] += 5  # every turn outlasts the hold: the others always get theirs
        chosen = traces_of(turns, "a", "b", "c")
        assert chosen is not None
        served.append(chosen)
        run_turn(turns, chosen)
        now[0] += 0.5
        assert traces_of(turns, "a", "b", "c") == chosen  # the others wait from the switch: within the hold
    # a has waited longest and goes first; then each in turn, although a's oldest trace stays the oldest.
    assert served == ["a", "b", "c", "a", "b", "c"]


def test_a_domain_alone_keeps_the_engine_however_long() -> None:
    now = [0.0]
    turns = DomainTurns(hold_s=1, clock=lambda: now[0])
    for index in range(3):
        assert traces_of(turns, "a") == "a"
        turns.claimed(Grant("a"), [index])
        now[0] += 100
    assert turns.in_flight == 3 and not turns.others_wait()


def test_a_switch_waits_for_the_turn_to_end_and_then_for_its_verification() -> None:
    now = [0.0]
    turns = DomainTurns(hold_s=1, clock=lambda: now[0])
    assert traces_of(turns, "a", "b") == "a"
    first = turns.claimed(Grant("a"), [1, 2])
    assert first is not None and (first.previous, first.domain) == (None, "a")
    turns.verified(first)
    now[0] = 2
    assert traces_of(turns, "a", "b") is None  # the hold is over, but a's traces run
    assert turns.others_wait()
    with pytest.raises(RuntimeError, match="in flight"):
        turns.claimed(Grant("b"), [3])
    assert not turns.ended(1) and turns.ended(2)
    assert traces_of(turns, "a", "b") == "b"
    switch = turns.claimed(Grant("b"), [3])
    assert switch is not None and (switch.previous, switch.domain) == ("a", "b")
    assert turns.unverified() is switch
    turns.verified(switch)
    assert turns.unverified() is None and turns.current == "b"


def test_a_token_that_found_nothing_waits_although_the_turn_ended_since_its_claim() -> None:
    # The claim saw a's last trace in flight and the hold over; that trace ended before the token asked whether to
    # keep waiting: b's traces still wait for this worker, so the token must not be dropped (it was: b's trace then
    # waited ~28 s for the reconciler in benchmarks/trust_domains.py).
    now = [0.0]
    turns = DomainTurns(hold_s=1, clock=lambda: now[0])
    assert traces_of(turns, "a", "b") == "a"
    turns.claimed(Grant("a"), ["t"])
    now[0] = 2
    assert traces_of(turns, "a", "b") is None
    assert turns.ended("t")
    assert turns.others_wait()
    assert traces_of(turns, "b") == "b"  # the claim again: b's turn, and nothing is left waiting
    assert not turns.others_wait()


def test_a_claim_that_chose_one_of_several_waiting_domains_keeps_the_tokens_it_could_not_serve() -> None:
    # Four tokens claim together, two traces of a and two of b queued: a's turn takes two; the other two tokens
    # wait for it to end (b's traces), as they did before the change above (caught by the suite's job test).
    turns = DomainTurns(hold_s=1, clock=lambda: 0.0)
    assert traces_of(turns, "a", "b") == "a"
    assert turns.others_wait()


def test_a_claim_of_nothing_switches_nothing() -> None:
    turns = DomainTurns()
    assert traces_of(turns, "a") == "a"
    assert turns.claimed(Grant("a")) is None  # another worker took it meanwhile
    assert turns.current is None and turns.unverified() is None


# With all_work (NNQUEUE_DOMAIN_SWITCH=restart), a domain's turn covers its steering jobs and harvest chunks too: an
# engine that ran a domain's trace runs no other domain's work until a fresh engine replaces it.


def all_work_turns(now: list[float]) -> DomainTurns:
    return DomainTurns(hold_s=10, clock=lambda: now[0], all_work=True)


def test_an_engine_that_ran_no_trace_takes_anyones_work_and_a_domains_first_trace_gets_a_fresh_one() -> None:
    now = [0.0]
    turns = all_work_turns(now)
    assert turns.choose({}, waiting("a", "b")) == Grant(None)  # anyone's steering jobs and chunks
    assert turns.claimed(Grant(None), work={"ja": "a", "jb": "b"}) is None
    # c's traces wait: c's turn begins; everything in flight drains first (c's own steering waits too).
    assert turns.choose(waiting("c"), waiting("a", "c")) == Grant(None, frozenset())
    assert turns.others_wait()
    now[0] = 20  # a drain longer than the hold: the hold starts with c's traces
    assert not turns.ended("ja") and turns.ended("jb")  # the drain is over: c's traces may start
    grant = turns.choose(waiting("c"), waiting("a", "c"))
    assert grant == Grant("c", frozenset({"c"}))
    # a's and b's prompts were on this engine (a sixth red-team round read them back from a plain trace's KV cache
    # reads): c's traces run on a fresh one.
    first = turns.claimed(grant, ["tc"], {"jc": "c"})
    assert first is not None and (first.previous, first.domain) == ("a, b", "c")
    assert turns.exposed and turns.current == "c" and turns.unverified() is first
    turns.verified(first)
    assert turns.choose(waiting("c"), waiting("a")) == Grant("c", frozenset({"c"}))
    now[0] = 30
    assert turns.choose(waiting("c"), waiting("a")) == Grant(None, frozenset())  # now a has waited the hold


def test_a_domains_first_trace_on_an_engine_that_ran_only_its_own_work_needs_no_fresh_one() -> None:
    turns = all_work_turns([0.0])
    turns.claimed(turns.choose({}, waiting("c")), work={"jc": "c"})
    grant = turns.choose(waiting("c"), waiting("c"))
    assert grant == Grant("c", frozenset({"c"}))  # its own steering job may go on meanwhile
    first = turns.claimed(grant, ["tc"])
    assert first is not None and (first.previous, first.domain) == (None, "c")


def test_another_domains_steering_job_waits_for_the_turn_and_runs_on_a_fresh_engine() -> None:
    now = [0.0]
    turns = all_work_turns(now)
    grant = turns.choose(waiting("m"))
    turns.verified(turns.claimed(grant, ["tm"]))  # type: ignore[arg-type]
    # Alice's steering job waits while mallory's traces keep the engine (within the hold), then while they run.
    assert turns.choose(waiting("m"), waiting("alice")) == Grant("m", frozenset({"m"}))
    now[0] = 10
    assert turns.choose(waiting("m"), waiting("alice")) == Grant(None, frozenset())
    assert turns.ended("tm")
    grant = turns.choose(waiting("m"), waiting("alice"))
    assert grant == Grant(None, frozenset({"alice"}))
    switch = turns.claimed(grant, work={"steer": "alice"})
    assert switch is not None and (switch.previous, switch.domain) == ("m", "alice")  # a restart: m's code ran
    assert turns.unverified() is switch and not turns.exposed
    turns.verified(switch)
    # The fresh engine ran no trace: anyone's work, though mallory's traces wait, while alice's turn lasts.
    now[0] = 15
    assert turns.choose(waiting("m"), waiting("alice", "bob")) == Grant(None)
    assert turns.others_wait()  # mallory's tokens wait for it
    now[0] = 20.5
    assert turns.choose(waiting("m"), waiting("alice")) == Grant(None, frozenset())  # alice's job still runs
    assert turns.ended("steer")
    grant = turns.choose(waiting("m"), waiting("alice"))
    assert grant == Grant("m", frozenset({"m"}))  # then mallory's, on a fresh engine: alice's work ran on this one
    switch = turns.claimed(grant, ["tm2"])
    assert switch is not None and (switch.previous, switch.domain) == ("alice", "m")


def test_a_domains_own_work_runs_in_its_turn_without_a_switch() -> None:
    now = [0.0]
    turns = all_work_turns(now)
    turns.verified(turns.claimed(turns.choose(waiting("a")), ["t1"]))  # type: ignore[arg-type]
    grant = turns.choose(waiting("a"), waiting("a"))
    assert grant == Grant("a", frozenset({"a"}))
    assert turns.claimed(grant, ["t2"], {"chunk": "a"}) is None
    assert turns.in_flight == 3


def test_without_all_work_steering_jobs_and_chunks_are_not_counted() -> None:
    turns = DomainTurns()
    grant = turns.choose(waiting("a"), waiting("b"))
    assert grant == Grant("a")  # anyone's work
    turns.claimed(grant, ["t"], {"steer": "b"})
    assert turns.in_flight == 1 and not turns.ended("steer") and turns.ended("t")
