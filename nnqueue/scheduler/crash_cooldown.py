"""The crash cool-down: an owner whose traces crashed engines, stalled them or changed their state, again and again
submits no trace for a while.

A trace that kills its engine fails alone (``EngineCrash``, :mod:`nnqueue.workers.engine_health`), but it
costs every user of the model the worker's restart (the engine loads again); a trace that changes an engine's
weights or state alone in its step (``WeightsModified``, ``StateModified``: the engine put it back,
:mod:`nnqueue.enginecore.weights_guard`) makes the traces that shared steps with it run again; a trace whose
code stalls past the step deadline (``InterventionStalled``, :mod:`nnqueue.workers.stall_deadline`) holds every
other job of the engine for the stall timeout, and then costs the restart of the engine it was stopped in. Each
of these is charged to the job's owner (:data:`CHARGED_ERRORS`; a job that only shared a step is never charged: it
ran again alone first). When ``limit`` of one owner's jobs were charged within ``window_s`` of each other, every key of
that owner has its new traces refused (429, with ``Retry-After``) until ``cooldown_s`` after the last of them:
per owner, not per key, so a second key does not start afresh. Harvests and steering (declarative, no user code)
are not refused.

Read at a trace submission at most every ``max_age_s`` per owner (one lookup of the owner's failed jobs through
their keys, ``ix_jobs_api_key_id_status``, at most ``limit`` rows): an owner found clear is taken for clear that
long (so a charge is acted on up to ``max_age_s`` late), and an owner found cooling is remembered until the
cool-down ends, so neither a busy owner nor a client retrying in a loop costs a query per submission.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from nnqueue.db.models import ApiKey, Job, JobStatus, utcnow
from nnqueue.errors import NNqueueError

ENGINE_CRASH = "EngineCrash"
# What a job's owner is charged for: its trace crashed an engine, stalled it past the step deadline, or changed an
# engine's parameters or other state alone in its step (nnqueue.enginecore.weights_guard's ERROR_TYPE and
# STATE_ERROR_TYPE).
CHARGED_ERRORS = (ENGINE_CRASH, "InterventionStalled", "WeightsModified", "StateModified")


class CrashCooldown(NNqueueError):
    """The owner's traces crashed engines (or changed their state) ``limit`` times within the window;
    ``retry_after_s`` says for how long more its traces are refused."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class CrashCooldowns:
    limit: int
    window_s: float
    cooldown_s: float
    max_age_s: float = 1.0
    # Owners found cooling, and until when (UTC): refused again without a query.
    _until: dict[str, datetime] = field(default_factory=dict)
    # Owners found clear, and when (monotonic): taken for clear for ``max_age_s`` without a query.
    _clear: dict[str, float] = field(default_factory=dict)

    def check(self, session: Session, owner: str) -> None:
        """Raise :class:`CrashCooldown` if ``owner`` is cooling down after ``limit`` charged jobs."""
        now = utcnow()
        until = self._until.get(owner)
        if until is None or until <= now:
            self._until.pop(owner, None)
            if time.monotonic() - self._clear.get(owner, -math.inf) < self.max_age_s:
                return
            until = self._cooling_until(session, owner, now)
            if until is None:
                _remember(self._clear, owner, time.monotonic())
                return
            _remember(self._until, owner, until)
        wait = (until - now).total_seconds()
        raise CrashCooldown(
            f"traces of this owner crashed the engine, stalled it or changed its state {self.limit} times within "
            f"{self.window_s:g} s; its keys may submit traces again in {math.ceil(wait)} s "
            "(NNQUEUE_ENGINE_CRASH_COOLDOWN_S). The failed jobs' errors say what happened",
            wait,
        )

    def _cooling_until(self, session: Session, owner: str, now: datetime) -> datetime | None:
        since = now - timedelta(seconds=self.window_s + self.cooldown_s)
        keys = select(ApiKey.id).where(ApiKey.owner == owner).scalar_subquery()
        query = (
            select(Job.finished_at)
            .where(
                Job.api_key_id.in_(keys),
                Job.status == JobStatus.FAILED,
                Job.error_type.in_(CHARGED_ERRORS),
                Job.finished_at >= since,
            )
            .order_by(Job.finished_at.desc())
            .limit(self.limit)
        )
        crashes = [moment for moment in session.scalars(query) if moment is not None]
        if len(crashes) < self.limit:
            return None
        if (crashes[0] - crashes[-1]).total_seconds() > self.window_s:
            return None
        until = crashes[0] + timedelta(seconds=self.cooldown_s)
        return until if until > now else None


def _remember(memo: dict[str, Any], owner: str, value: object) -> None:
    if len(memo) >= 10_000:  # bounded: forgetting only costs a query
        memo.clear()
    memo[owner] = value
