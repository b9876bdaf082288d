"""Domain turns: an engine runs the traces of one trust domain at a time, and domains take turns on it.

Each worker keeps a :class:`DomainTurns`: the domain whose traces its engine runs now (``current``) and what runs
here. Every claim (:func:`nnqueue.scheduler.claim.claim_jobs`, :func:`~nnqueue.scheduler.claim.claim_next_chunk`)
first asks it what it may take (:meth:`DomainTurns.choose`, given the domains whose work waits: a :class:`Grant`),
then tells it what it took (:meth:`DomainTurns.claimed`), and each unit's end is told too (:meth:`DomainTurns.ended`).

* **A switch happens only with nothing of the old domain in flight.** While traces of ``current`` run here, a claim
  takes traces of ``current`` or none. When the last of them has ended, the next claim may pick another domain;
  the worker then puts back and verifies the engine's state (``JobRunner``'s switch, with the weights guard's
  full check; under ``NNQUEUE_DOMAIN_SWITCH=restart`` on a fresh engine process) before any trace of the new
  domain starts (:meth:`DomainTurns.unverified`).
* **Switches are rare: a domain keeps the engine while it has queued traces**, so one domain's traces batch
  together; a switch costs the drain (the engine runs the old domain's last traces with its batch emptying) and
  the verification (one read of the weights) or the fresh engine.
* **No domain starves:** once another domain's work waits, ``current`` keeps the engine for ``hold_s`` more
  (``NNQUEUE_DOMAIN_HOLD_S``), then takes no new work; when its work in flight has ended, the engine
  switches. Waiting domains take turns round robin (the one whose last turn here ended longest ago first, then
  the one waiting longest), so a domain waits at most about ``hold_s`` plus its work's run time per other
  domain with work.
* **Harvests and steering jobs** run no user code. With ``all_work`` (``NNQUEUE_DOMAIN_SWITCH=restart``, where a
  domain's traces are assumed able to do anything inside the engine's process: a fifth red-team round's escaped
  trace read another owner's steering prompt and forged its result) they run only on an engine that has run no
  other domain's trace: an engine that ran no trace yet takes anyone's (they run together, as before); once a
  domain's traces wait, that domain's turn begins, the work in flight drains, then its traces start, on a fresh
  engine if another domain's work ran on this one (a sixth round read its prompts back from the KV cache with a
  plain trace); from then on the engine takes that domain's work of every kind, and the next domain's work
  (traces or not) runs on a fresh engine. Without ``all_work`` (``verify``, which trusts the guards) any claim
  takes them.
* ``allowed``: the trace domains this worker may take at all (None: any), for a worker whose engine cannot be
  isolated (it then serves harvests, steering and its own operator's traces only).

Claims run in threads and work ends on the engine's loop: the state is behind a lock, held for no query; a claim
holds :meth:`DomainTurns.claiming` from its choice to its record, so that a job claim and a chunk claim never act
on one choice twice.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from nnqueue.settings import DOMAIN_HOLD_S

# How long a domain keeps an engine once another domain's work waits: NNQUEUE_DOMAIN_HOLD_S's default with
# NNQUEUE_DOMAIN_SWITCH=verify (a worker passes its settings' own).
DEFAULT_HOLD_S: float = DOMAIN_HOLD_S["verify"]


@dataclass(frozen=True, eq=False)
class Switch:
    """The engine's move from ``previous`` (None: nothing ran on it yet, or nothing that needs putting back) to
    ``domain``."""

    previous: str | None
    domain: str


@dataclass(frozen=True)
class Grant:
    """What one claim may take: traces of ``traces`` (None: no trace), and the steering jobs and harvest chunks of
    the domains in ``work`` (None: of any domain)."""

    traces: str | None
    work: frozenset[str] | None = None


NOTHING = Grant(None, frozenset())


@dataclass
class DomainTurns:
    hold_s: float = DEFAULT_HOLD_S
    allowed: frozenset[str] | None = None
    clock: Callable[[], float] = time.monotonic
    # A domain's turn covers its steering jobs and harvest chunks too (NNQUEUE_DOMAIN_SWITCH=restart: see above).
    all_work: bool = False
    current: str | None = None
    exposed: bool = False  # with all_work: a trace of ``current`` was claimed for this engine
    # What runs here, by unit (a job's id, a chunk's key) and its domain: traces (and with all_work, all work).
    _units: dict[Hashable, str] = field(default_factory=dict)
    _others_since: float | None = None  # since when other domains' work has waited during this turn
    _last_turn: dict[str, float] = field(default_factory=dict)  # when each domain's last turn here ended
    _switch: Switch | None = None  # the switch whose verification has not finished
    _wait_after_switch = False  # whether other domains than the one chosen to switch to wait too
    _deferred = False  # whether the last choice left work waiting for the current turn (or a drain)
    _work_turn: tuple[str, float] | None = None  # the domain a switch was made for, without traces, and when
    _ran: set[str] = field(default_factory=set)  # with all_work: the domains whose work this engine has run
    _lock: threading.Lock = field(default_factory=threading.Lock)
    claiming: threading.Lock = field(default_factory=threading.Lock)  # held by a claim from choice to record

    @property
    def in_flight(self) -> int:
        """The units of ``current`` running here."""
        return sum(domain == self.current for domain in self._units.values())

    def choose(self, traces: Mapping[str, datetime], work: Mapping[str, datetime] | None = None) -> Grant:
        """What the next claim may take, given the domains whose traces wait for this worker and (read with
        ``all_work`` only) the domains whose steering jobs or harvest chunks do, each with its oldest one's time."""
        with self._lock:
            if self.all_work:
                return self._choose_all(traces, work or {}, self.clock())
            return Grant(self._choose_traces(traces, self.clock()))

    def _choose_traces(self, waiting: Mapping[str, datetime], now: float) -> str | None:
        others = [domain for domain in waiting if domain != self.current]
        yielding = self._yielding(bool(others), now)
        self._deferred = bool(others)
        if self.in_flight:
            return None if yielding else self.current
        if self.current in waiting and not yielding:
            return self.current
        if not others:
            return self.current if self.current in waiting else None
        # The others wait from the new turn's start (and a token of this claim that finds none of its traces
        # waits for that turn to end).
        self._wait_after_switch = self._deferred = len(waiting) > 1
        return self._next(others, waiting)

    def _choose_all(self, traces: Mapping[str, datetime], work: Mapping[str, datetime], now: float) -> Grant:
        if self.current is not None and not self.exposed and self.current not in traces:
            self.current = None  # its traces were taken or cancelled meanwhile: no turn to wait for
        if self.current is None:  # no trace ran on this engine: anyone's work, until a domain's traces wait
            self._deferred = bool(traces)
            if not traces or self._work_turn_lasts(work, now):
                self._others_since = None
                return Grant(None)
            self.current = self._next(list(traces), traces)
        domain = self.current
        waiting = {**work, **traces}
        others = [other for other in waiting if other != domain]
        # Before its first trace a turn only waits for the others' work to drain: the hold starts with its traces.
        yielding = self._yielding(bool(others), now) and self.exposed
        self._deferred = bool(others)
        if not self.exposed and self._ran - {domain} and self._units:
            # Other domains' work ran on this engine: its traces need a fresh one, so everything in flight (its own
            # work too, which would be handed back) ends first.
            self._deferred = True
            return NOTHING
        if self.in_flight:
            return NOTHING if yielding else Grant(domain, frozenset({domain}))
        if not others or (domain in waiting and not yielding):
            return Grant(domain, frozenset({domain}))
        # The turn ends on an engine that ran this domain's traces: the next domain's work runs on a fresh one.
        chosen = self._next(others, waiting)
        self._wait_after_switch = self._deferred = len(waiting) > 1
        return Grant(chosen if chosen in traces else None, frozenset({chosen}))

    def _work_turn_lasts(self, work: Mapping[str, datetime], now: float) -> bool:
        """Whether the turn that a switch began for a domain's steering jobs or chunks (no trace of it waited) lasts:
        for ``hold_s`` while they wait, as a turn of traces would."""
        if self._work_turn is not None:
            domain, since = self._work_turn
            if domain in work and now - since < self.hold_s:
                return True
            self._work_turn = None
        return False

    def _yielding(self, others: bool, now: float) -> bool:
        """Whether the turn is over because other domains have waited ``hold_s`` (false when none wait)."""
        if not others:
            self._others_since = None
        elif self._others_since is None:
            self._others_since = now
        return self._others_since is not None and now - self._others_since >= self.hold_s

    def _next(self, candidates: list[str], waiting: Mapping[str, datetime]) -> str:
        """The candidate whose last turn here ended longest ago, then the one waiting longest."""
        return min(candidates, key=lambda domain: (self._last_turn.get(domain, -math.inf), waiting[domain]))

    def claimed(
        self, grant: Grant, traces: Collection[Hashable] = (), work: Mapping[Hashable, str] | None = None
    ) -> Switch | None:
        """A claim given ``grant`` took the traces ``traces`` (of ``grant.traces``) and the steering jobs and chunks
        ``work`` (each with its domain; counted with ``all_work`` only); the switch it made, if any."""
        units: dict[Hashable, str] = dict(work or {}) if self.all_work else {}
        if grant.traces is not None:
            units.update(dict.fromkeys(traces, grant.traces))
        if not units:
            return None
        with self._lock:
            if self.all_work:
                switch = self._claimed_all(grant, bool(traces) and grant.traces is not None, set(units.values()))
                self._ran.update(units.values())
            else:
                switch = self._move(grant.traces) if grant.traces != self.current else None  # type: ignore[arg-type]
            self._units.update(units)
            return switch

    def _claimed_all(self, grant: Grant, traces: bool, domains: set[str]) -> Switch | None:
        switch = None
        if self.exposed and domains != {self.current}:  # the turn ended (choose gave one other domain's work)
            switch = self._move(domains.pop())
            if not traces:
                self._work_turn = (switch.domain, self.clock())
        if traces and not self.exposed:
            self._others_since = None  # the hold starts with its traces, not with the drain before them
            others = sorted(self._ran - {grant.traces})
            if self._switch is None and others:  # choose() gave the traces with nothing in flight
                # Other domains' steering jobs or chunks ran on this engine: what they left (their prompts in the KV
                # cache, a sixth red-team round read them from a plain trace) must not meet this domain's code.
                switch = self._move(grant.traces, previous=", ".join(others))  # type: ignore[arg-type]
            elif self._switch is None:  # the engine's first work: nothing ran that needs putting back
                switch = self._switch = Switch(None, grant.traces)  # type: ignore[arg-type]
            self.exposed = True
        return switch

    def _move(self, domain: str, previous: str | None = None) -> Switch:
        """The engine moves to ``domain`` from ``previous`` (default: ``current``), on a fresh engine with
        ``all_work`` (the lock held)."""
        if self._units:  # choose() never gives another domain then: a caller's bug, not a user's
            raise RuntimeError(f"work of {self.current!r} is in flight: no switch to {domain!r}")
        if self.current is not None:
            self._last_turn[self.current] = self.clock()
        switch = self._switch = Switch(previous or self.current, domain)
        self.current, self.exposed, self._ran = domain, False, set()
        self._others_since = self.clock() if self._wait_after_switch else None
        return switch

    def ended(self, unit: Hashable) -> bool:
        """A claimed unit (a job's id, a chunk's key) ended here; whether that left nothing in flight (a turn may end)
        or nothing but the current domain's (the drain before its traces is over)."""
        with self._lock:
            domain = self._units.pop(unit, None)
            if domain is None:
                return False  # not counted (a steering job or chunk without all_work)
            left = set(self._units.values())
            return not left or (domain != self.current and left == {self.current})

    def others_wait(self) -> bool:
        """Whether the last claim left work waiting that this worker takes once its current turn (or the drain
        before it) ends: a token that found no work then waits for that end (or claims again at once, should the
        turn's last unit have ended meanwhile) instead of being dropped, which would leave that work to the
        reconciler."""
        with self._lock:
            return self._deferred

    def unverified(self) -> Switch | None:
        """The switch whose verification has not finished (work of its domain waits for it), if any."""
        with self._lock:
            return self._switch

    def verified(self, switch: Switch) -> None:
        """The engine's state was put back and verified for ``switch``: its domain's work may start."""
        with self._lock:
            if self._switch is switch:
                self._switch = None
