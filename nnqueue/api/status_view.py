"""What the status page shows, read from the database in a few queries: models, workers (and the trust domain each
engine serves: named when it is the viewer's, else "other", unless the viewer is an admin), jobs and harvests.

A viewer sees their own jobs and harvests; an ``admin`` key sees everyone's (with an owner column). Each section
is a list of plain rows that the template renders on its own: a new kind of work is one more query here and one
more block in ``templates/status.html``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from nnqueue.db.models import Harvest, Job, JobStatus, Worker, utcnow
from nnqueue.scheduler.harvests import HarvestProgress, progress, recent_harvests
from nnqueue.scheduler.overview import ModelLoad, model_loads
from nnqueue.scheduler.positions import queue_positions
from nnqueue.scheduler.registry import live_workers
from nnqueue.scheduler.trust_domains import Mode, domain_of, shown

ADMIN_SCOPE = "admin"
JOBS_SHOWN = 50
HARVESTS_SHOWN = 20


@dataclass(frozen=True)
class Viewer:
    owner: str
    key_prefix: str
    is_admin: bool

    def may_see(self, owner: str) -> bool:
        """Whether this viewer may see ``owner``'s jobs: their own, or anyone's for an admin."""
        return self.is_admin or owner == self.owner


@dataclass(frozen=True)
class WorkerRow:
    worker: Worker
    running: int
    heartbeat_age_s: float
    domain: str | None  # the trust domain its engine serves, as the viewer may see it; None: no trace ran yet

    @property
    def isolation(self) -> str | None:
        """``full``, or why the worker's engine is not fully isolated (it then runs only its operator's traces), as
        it registered it (``/readyz`` says the same); None when it reported none."""
        return (self.worker.containment or {}).get("isolation")


@dataclass(frozen=True)
class JobRow:
    job: Job
    queue_position: int | None

    @property
    def progress_percent(self) -> int:
        done, total = self.job.progress_done, self.job.progress_total
        if self.job.status is JobStatus.COMPLETED:
            return 100
        return 0 if not total else min(100, round(100 * done / total))


@dataclass(frozen=True)
class HarvestRow:
    harvest: Harvest
    progress: HarvestProgress

    @property
    def progress_percent(self) -> int:
        if self.harvest.status is JobStatus.COMPLETED:
            return 100
        total = self.progress.chunks_total
        return 0 if not total else min(100, round(100 * self.progress.chunks_done / total))


@dataclass
class StatusView:
    viewer: Viewer
    now: datetime
    models: list[ModelLoad]
    workers: list[WorkerRow]
    jobs: list[JobRow]
    status_filter: JobStatus | None
    job_counts: dict[str, int] = field(default_factory=dict)
    harvests: list[HarvestRow] = field(default_factory=list)


def status_view(
    session: Session,
    viewer: Viewer,
    stale_after_s: float,
    status_filter: JobStatus | None = None,
    trust_domains: Mode = "owner",
) -> StatusView:
    now = utcnow()
    return StatusView(
        viewer=viewer,
        now=now,
        models=model_loads(session, stale_after_s),
        workers=_workers(session, stale_after_s, now, viewer, domain_of(session, viewer.owner, trust_domains)),
        jobs=_jobs(session, viewer, status_filter),
        status_filter=status_filter,
        job_counts=_job_counts(session, viewer),
        harvests=_harvests(session, viewer),
    )


def _workers(session: Session, stale_after_s: float, now: datetime, viewer: Viewer, yours: str) -> list[WorkerRow]:
    running = dict(
        session.execute(
            select(Job.worker_id, func.count()).where(Job.status == JobStatus.RUNNING).group_by(Job.worker_id)
        ).all()
    )
    return [
        WorkerRow(
            worker,
            running.get(worker.id, 0),
            (now - (worker.heartbeat_at or now)).total_seconds(),
            None if worker.domain is None else shown(worker.domain, yours, viewer.is_admin),
        )
        for worker in live_workers(session, stale_after_s)
    ]


def _jobs(session: Session, viewer: Viewer, status_filter: JobStatus | None) -> list[JobRow]:
    query = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(JOBS_SHOWN)
    if not viewer.is_admin:
        query = query.where(Job.owner == viewer.owner)
    if status_filter is not None:
        query = query.where(Job.status == status_filter)
    jobs = list(session.scalars(query))
    positions: dict[uuid.UUID, int] = queue_positions(session, jobs)
    return [JobRow(job, positions.get(job.id)) for job in jobs]


def _job_counts(session: Session, viewer: Viewer) -> dict[str, int]:
    query = select(Job.status, func.count()).group_by(Job.status)
    if not viewer.is_admin:
        query = query.where(Job.owner == viewer.owner)
    return {status.value: count for status, count in session.execute(query)}


def _harvests(session: Session, viewer: Viewer) -> list[HarvestRow]:
    harvests = recent_harvests(session, None if viewer.is_admin else viewer.owner, None, HARVESTS_SHOWN)
    done = progress(session, harvests)
    return [HarvestRow(harvest, done[harvest.id]) for harvest in harvests]
