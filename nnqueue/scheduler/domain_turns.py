"""Domain turns: an engine runs the traces of one trust domain at a time, and domains take turns on it.

Each worker keeps a :class:`DomainTurns`: the domain whose traces its engine runs now (``current``) and how many of
them are in flight here. Every claim (:func:`nnqueue.scheduler.claim.claim_jobs`) first asks it which one domain's
traces it may take (:meth:`DomainTurns.choose`, given the domains whose traces wait), then tells it what it took
(:meth:`DomainTurns.claimed`). Harvests and steering jobs run no user code: any claim takes them.

* **A switch happens only with nothing of the old domain in flight.** While traces of ``current`` run here, a claim
  takes traces of ``current`` or none. When the last of them has ended, the next claim may pick another domain;
  the worker then puts back and verifies the engine's state (``JobRunner``'s switch, with the weights guard's
  full check) before any trace of the new domain starts (:meth:`DomainTurns.unverified`).
* **Switches are rare: a domain keeps the engine while it has queued traces**, so one domain's traces batch
  together; a switch costs the drain (the engine runs the old domain's last traces with its batch emptying) and
  the verification (one read of the weights), never a reload.
* **No domain starves:** once another domain's traces wait, ``current`` keeps the engine for ``hold_s`` more
  (``NNQUEUE_DOMAIN_HOLD_S``), then takes no new traces; when its traces in flight have ended, the engine
  switches. Waiting domains take turns round robin (the one whose last turn here ended longest ago first, then
  the one waiting longest), so a domain waits at most about ``hold_s`` plus its traces' run time per other
  domain with work.
* ``allowed``: the trace domains this worker may take at all (None: any), for a worker whose engine cannot be
  isolated (it then serves harvests, steering and its own operator's traces only).

Claims run in a thread and jobs end on the engine's loop: the state is behind a lock, held for no query.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from nnqueue.settings import DOMAIN_HOLD_S

# How long a domain keeps an engine once another domain's traces wait: NNQUEUE_DOMAIN_HOLD_S's default with
# NNQUEUE_DOMAIN_SWITCH=verify (a worker passes its settings' own).
DEFAULT_HOLD_S: float = DOMAIN_HOLD_S["verify"]


@dataclass(frozen=True, eq=False)
class Switch:
    """The engine's move from ``previous`` (None: nothing ran on it yet) to ``domain``."""

    previous: str | None
    domain: str


@dataclass
class DomainTurns:
    hold_s: float = DEFAULT_HOLD_S
    allowed: frozenset[str] | None = None
    clock: Callable[[], float] = time.monotonic
    current: str | None = None
    in_flight: int = 0  # traces of ``current`` running on this worker
    _others_since: float | None = None  # since when other domains' traces have waited during this turn
    _last_turn: dict[str, float] = field(default_factory=dict)  # when each domain's last turn here ended
    _switch: Switch | None = None  # the switch whose verification has not finished
    _wait_after_switch = False  # whether other domains than the one chosen to switch to wait too
    _deferred = False  # whether the last choice left other domains' traces waiting for the current turn
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def choose(self, waiting: Mapping[str, datetime]) -> str | None:
        """The one domain whose traces the next claim may take (None: none), given the domains whose traces wait
        for this worker (each with its oldest queued trace's time)."""
        with self._lock:
            now = self.clock()
            others = [domain for domain in waiting if domain != self.current]
            if not others:
                self._others_since = None
            elif self._others_since is None:
                self._others_since = now
            yielding = self._others_since is not None and now - self._others_since >= self.hold_s
            self._deferred = bool(others)
            if self.in_flight:
                return None if yielding else self.current
            if self.current in waiting and not yielding:
                return self.current
            if not others:
                return self.current if self.current in waiting else None
            chosen = min(others, key=lambda domain: (self._last_turn.get(domain, -math.inf), waiting[domain]))
            # The others wait from the new turn's start (and a token of this claim that finds none of its traces
            # waits for that turn to end).
            self._wait_after_switch = self._deferred = len(waiting) > 1
            return chosen

    def claimed(self, domain: str | None, traces: int) -> Switch | None:
        """A claim took ``traces`` traces of ``domain`` (the one :meth:`choose` gave); the switch it made, if any."""
        if not traces or domain is None:
            return None
        with self._lock:
            switch = None
            if domain != self.current:
                if self.in_flight:  # choose() never gives another domain then: a caller's bug, not a user's
                    raise RuntimeError(f"traces of {self.current!r} are in flight: no switch to {domain!r}")
                if self.current is not None:
                    self._last_turn[self.current] = self.clock()
                switch = self._switch = Switch(self.current, domain)
                self.current = domain
                self._others_since = self.clock() if self._wait_after_switch else None
            self.in_flight += traces
            return switch

    def ended(self) -> bool:
        """A trace of ``current`` ended here; whether it was the last one in flight (the turn may end)."""
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)
            return self.in_flight == 0

    def others_wait(self) -> bool:
        """Whether the last claim left traces of other domains waiting, which this worker takes once its current
        turn ends: a token that found no job then waits for that end (or claims again at once, should the turn's
        last trace have ended meanwhile) instead of being dropped, which would leave those traces to the
        reconciler."""
        with self._lock:
            return self._deferred

    def unverified(self) -> Switch | None:
        """The switch whose verification has not finished (traces of its domain wait for it), if any."""
        with self._lock:
            return self._switch

    def verified(self, switch: Switch) -> None:
        """The engine's state was put back and verified for ``switch``: its domain's traces may start."""
        with self._lock:
            if self._switch is switch:
                self._switch = None
