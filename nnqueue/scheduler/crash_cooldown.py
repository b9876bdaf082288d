"""The crash cool-down: an API key whose traces crashed engines again and again submits no trace for a while.

A trace that kills its engine fails alone (``EngineCrash``, :mod:`nnqueue.workers.engine_health`), but it
costs every user of the model the worker's restart (the engine loads again). So when ``limit`` jobs of one key
failed with ``EngineCrash`` within ``window_s`` of each other, that key's new traces are refused (429, with
``Retry-After``) until ``cooldown_s`` after the last of them. Harvests (declarative, no user code) are not.

Read at a key's trace submission at most every ``max_age_s`` (one lookup in a partial index of the crashed jobs,
``ix_jobs_engine_crashes``, at most ``limit`` rows): a key found clear is taken for clear that long (so a crash
is acted on up to ``max_age_s`` late), and a key found cooling is remembered until its cool-down ends, so
neither a busy key nor a client retrying in a loop costs a query per submission.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from nnqueue.db.models import Job, utcnow
from nnqueue.errors import NNqueueError

ENGINE_CRASH = "EngineCrash"


class CrashCooldown(NNqueueError):
    """The key's traces crashed engines ``limit`` times within the window; ``retry_after_s`` says for how long
    more its traces are refused."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class CrashCooldowns:
    limit: int
    window_s: float
    cooldown_s: float
    max_age_s: float = 1.0
    # Keys found cooling, and until when (UTC): refused again without a query.
    _until: dict[int, datetime] = field(default_factory=dict)
    # Keys found clear, and when (monotonic): taken for clear for ``max_age_s`` without a query.
    _clear: dict[int, float] = field(default_factory=dict)

    def check(self, session: Session, api_key_id: int) -> None:
        """Raise :class:`CrashCooldown` if the key is cooling down after ``limit`` engine crashes."""
        now = utcnow()
        until = self._until.get(api_key_id)
        if until is None or until <= now:
            self._until.pop(api_key_id, None)
            if time.monotonic() - self._clear.get(api_key_id, -math.inf) < self.max_age_s:
                return
            until = self._cooling_until(session, api_key_id, now)
            if until is None:
                _remember(self._clear, api_key_id, time.monotonic())
                return
            _remember(self._until, api_key_id, until)
        wait = (until - now).total_seconds()
        raise CrashCooldown(
            f"traces of this API key crashed the engine {self.limit} times within {self.window_s:g} s; it may "
            f"submit traces again in {math.ceil(wait)} s (NNQUEUE_ENGINE_CRASH_COOLDOWN_S). The failed jobs' "
            "errors say what crashed it",
            wait,
        )

    def _cooling_until(self, session: Session, api_key_id: int, now: datetime) -> datetime | None:
        since = now - timedelta(seconds=self.window_s + self.cooldown_s)
        query = (
            select(Job.finished_at)
            .where(Job.api_key_id == api_key_id, Job.error_type == ENGINE_CRASH, Job.finished_at >= since)
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


def _remember(memo: dict[int, Any], api_key_id: int, value: object) -> None:
    if len(memo) >= 10_000:  # bounded: forgetting only costs a query
        memo.clear()
    memo[api_key_id] = value
