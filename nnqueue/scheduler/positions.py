"""Where queued jobs stand: a job's 1-based place among its model's queued jobs, in the order workers claim them.

That order is the fair order (:mod:`nnqueue.scheduler.fair_share`: owners take turns, counting the jobs each already
runs), so another owner's flood ahead of a job does not push its place back. What no place counts: a worker whose
trust domain's turn is on finishes it first (at most ``NNQUEUE_DOMAIN_HOLD_S`` once others wait:
:mod:`nnqueue.scheduler.domain_turns`). The statements are built once: building them cost more CPU than running
them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ScalarSelect, and_, bindparam, func, or_, select
from sqlalchemy.orm import Session

from nnqueue.db.models import Job, JobStatus
from nnqueue.scheduler.fair_share import fair_order, ranked


def jobs_ahead(model_key: Any, owner: Any, priority: Any) -> ScalarSelect[int]:
    """How many of ``model_key``'s QUEUED jobs run before a job of ``owner`` with ``priority`` queued after all of
    them: its place less one, for the statement that adds the job (which cannot see it)."""
    queued = ranked(Job.model_key == model_key)
    mine = (Job.model_key == model_key) & (Job.owner == owner)
    running = select(func.count()).where(mine, Job.status == JobStatus.RUNNING).scalar_subquery()
    before_mine = select(func.count()).where(mine, Job.status == JobStatus.QUEUED, Job.priority >= priority)
    turn = running + before_mine.scalar_subquery() + 1
    # Same turn: a job of equal or higher priority was queued before it.
    ahead = or_(queued.c.turn < turn, and_(queued.c.turn == turn, queued.c.priority >= priority))
    return select(func.count()).select_from(queued).where(ahead).scalar_subquery()


_queued = ranked(Job.model_key.in_(bindparam("models", expanding=True)))
_place = func.row_number().over(partition_by=_queued.c.model_key, order_by=fair_order(_queued))
_placed = select(_queued.c.id, _place.label("place")).subquery()
_POSITIONS = select(_placed.c.id, _placed.c.place).where(_placed.c.id.in_(bindparam("ids", expanding=True)))


def queue_positions(session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, int]:
    """The place of each QUEUED job in ``jobs`` (jobs in other statuses are left out), in one query."""
    queued = [job for job in jobs if job.status is JobStatus.QUEUED]
    if not queued:
        return {}
    models = sorted({job.model_key for job in queued})
    rows = session.execute(_POSITIONS, {"models": models, "ids": [job.id for job in queued]})
    return {job_id: int(place) for job_id, place in rows}
