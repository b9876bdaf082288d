"""Fair share across owners: the order in which a model's queued jobs (traces and steering jobs) run.

First come, first served let one owner's flood of jobs hold every engine while another owner's one-step job waited
behind all of it (issue 34: 64 jobs of 2 s, 130 s for the innocent). Instead each owner takes turns, round robin,
counting what they already run: a queued job's *turn* is its place among its owner's queued jobs (highest priority,
then oldest) plus the owner's jobs RUNNING on the model. Jobs run lowest turn first, then highest priority, then
oldest. So an owner with nothing running goes before one with 64 running, and two owners with queues alternate:
under a flood, another owner's job is claimed by the next token a worker takes, i.e. within about one step of a
job ending. It is deficit round robin with one job as the quantum; ``priority`` orders an owner's own jobs and
breaks ties between owners.

Harvest chunks have their own queue and the same rule (:func:`nnqueue.scheduler.claim.claim_next_chunk`: the owner
with the fewest running chunks first).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Subquery, UnaryExpression, func, select

from nnqueue.db.models import Job, JobStatus


def ranked(where: ColumnElement[bool]) -> Subquery:
    """The QUEUED jobs that ``where`` selects, with their ``turn`` (see the module doc) among those jobs."""
    running = (
        select(Job.model_key, Job.owner, func.count().label("running"))
        .where(Job.status == JobStatus.RUNNING)
        .group_by(Job.model_key, Job.owner)
        .subquery()
    )
    place = func.row_number().over(
        partition_by=(Job.model_key, Job.owner), order_by=(Job.priority.desc(), Job.queued_at, Job.id)
    )
    return (
        select(
            Job.id,
            Job.model_key,
            Job.owner,
            Job.priority,
            Job.queued_at,
            (place + func.coalesce(running.c.running, 0)).label("turn"),
        )
        .outerjoin(running, (running.c.model_key == Job.model_key) & (running.c.owner == Job.owner))
        .where(Job.status == JobStatus.QUEUED, where)
        .subquery()
    )


def fair_order(jobs: Subquery) -> tuple[Any, ...]:
    """ORDER BY terms of the fair order over a :func:`ranked` subquery."""
    columns = jobs.c
    ordering: tuple[ColumnElement[Any] | UnaryExpression[Any], ...] = (
        columns.turn,
        columns.priority.desc(),
        columns.queued_at,
        columns.id,
    )
    return ordering
