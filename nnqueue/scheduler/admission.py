"""Admission: whether a new job may be accepted, checked by :func:`nnqueue.scheduler.submission.accept_job`
for every submitter (the API, the CLI, schedules), before anything is stored.

Two rules: some live worker serves the job's model (else :class:`ModelNotServed`: nothing would ever run it),
and the submitting API key has fewer than its limit of jobs queued or running (else
:class:`TooManyJobsInFlight`). The count is read as the job is added (by the same statement on Postgres, see
:mod:`nnqueue.scheduler.intake`), so submissions racing each other may pass it together: it bounds a key's load,
it is not an exact quota.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from nnqueue.db.models import Job, JobStatus
from nnqueue.errors import NNqueueError
from nnqueue.scheduler.registry import LiveModels
from nnqueue.settings import Settings

IN_FLIGHT = (JobStatus.QUEUED, JobStatus.RUNNING)
# A key's jobs in flight, counted up to its limit only: the count's cost stays bounded however many it has
# (parameters ``key`` and ``limit``; a null key counts none). Built once (building costs more CPU than running it).
IN_FLIGHT_COUNT = select(func.count()).select_from(
    select(Job.id)
    .where(Job.api_key_id == bindparam("key"), Job.status.in_(IN_FLIGHT))
    .limit(bindparam("limit"))
    .subquery()
)


class AdmissionRefused(NNqueueError):
    """A job was not accepted; the message says why and what to do."""


class ModelNotServed(AdmissionRefused):
    """No live worker serves the job's model; the message names the live models."""


class TooManyJobsInFlight(AdmissionRefused):
    """The submitting API key already has its limit of jobs queued or running."""


@dataclass(frozen=True)
class AdmissionPolicy:
    # A worker whose heartbeat is older than this does not count as serving its model.
    stale_after_s: float
    # Jobs one API key may have queued or running at once (jobs submitted without a key are not counted).
    max_jobs_in_flight_per_key: int
    # The live models, remembered between submissions (the API keeps one); None: read for every job.
    live_models: LiveModels | None = None

    @classmethod
    def from_settings(cls, settings: Settings, *, remember_live_models: bool = False) -> AdmissionPolicy:
        live = LiveModels(settings.worker_stale_after_s) if remember_live_models else None
        return cls(settings.worker_stale_after_s, settings.max_jobs_in_flight_per_key, live)


def require_served(session: Session, policy: AdmissionPolicy, model_key: str) -> None:
    """Return if some live worker serves ``model_key``, else raise :class:`ModelNotServed` naming the live models."""
    live = policy.live_models or LiveModels(policy.stale_after_s, max_age_s=0)
    if not live.serves(session, model_key):
        served = ", ".join(repr(key) for key in sorted(live.read(session))) or "none"
        raise ModelNotServed(f"no live worker serves model {model_key!r}; live models: {served}")


def refuse_if_full(in_flight: int, limit: int) -> None:
    """Raise :class:`TooManyJobsInFlight` if an API key with ``in_flight`` jobs queued or running is at ``limit``.
    The count itself is part of the statement that adds the job (:mod:`nnqueue.scheduler.intake`)."""
    if in_flight >= limit:
        raise TooManyJobsInFlight(
            f"this API key already has {in_flight} jobs queued or running; the limit is {limit} "
            "(NNQUEUE_MAX_JOBS_IN_FLIGHT_PER_KEY): wait for some to finish"
        )
