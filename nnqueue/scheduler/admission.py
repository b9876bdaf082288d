"""Admission: whether a new job may be accepted, checked by :func:`nnqueue.scheduler.submission.accept_job`
for every submitter (the API, the CLI, schedules), before anything is stored.

Two rules: some worker serves the job's model, live now or less than ``NNQUEUE_WORKER_RESTART_GRACE_S`` ago (a
crashed worker being restarted: its jobs queue meanwhile; else :class:`ModelNotServed`: nothing would run it),
and the submitting API key has fewer than its limit of jobs queued or running, and its owner fewer than the
owner's limit through all of its keys together (else :class:`TooManyJobsInFlight`: a second key does not
double an owner's share of the queue). The count is read as the job is added (by the same statement on Postgres, see
:mod:`nnqueue.scheduler.intake`), so submissions racing each other may pass it together: it bounds a key's load,
it is not an exact quota. A trace is also refused while its owner cools down after crashing engines or changing
their state (:mod:`nnqueue.scheduler.crash_cooldown`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from nnqueue.db.models import ApiKey, EngineKind, Job, JobStatus
from nnqueue.errors import NNqueueError
from nnqueue.scheduler.crash_cooldown import CrashCooldowns
from nnqueue.scheduler.registry import LiveModels
from nnqueue.scheduler.trust_domains import Mode
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
# An owner's jobs in flight through any of its keys, counted up to the owner's limit (parameters ``key_owner``, the
# owner of the submitting key, null for none, and ``owner_limit``): through each key's index, not the owner's history.
OWNER_IN_FLIGHT_COUNT = select(func.count()).select_from(
    select(Job.id)
    .where(
        Job.api_key_id.in_(select(ApiKey.id).where(ApiKey.owner == bindparam("key_owner"))),
        Job.status.in_(IN_FLIGHT),
    )
    .limit(bindparam("owner_limit"))
    .subquery()
)


class AdmissionRefused(NNqueueError):
    """A job was not accepted; the message says why and what to do."""


class ModelNotServed(AdmissionRefused):
    """No live worker serves the job's model; the message names the live models."""


class EngineNotServed(ModelNotServed):
    """The model is served, but by engines of other kinds than the job needs (``engines``)."""

    def __init__(self, message: str, engines: frozenset[str]) -> None:
        super().__init__(message)
        self.engines = engines


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
    # A model still counts as served this long after its last live worker (one being restarted).
    restart_grace_s: float = 0.0
    # Owners whose traces crashed engines (or changed their state) too often submit no traces for a while; None: off.
    crash_cooldowns: CrashCooldowns | None = None
    # Models served by a vLLM engine whether or not a worker runs (an autoscaler starts them on demand).
    scale_to_zero_models: tuple[str, ...] = ()
    # Whose traces may share an engine: each owner alone (and the groups admins made), or the whole deployment.
    trust_domains: Mode = "owner"
    # Jobs one owner may have queued or running at once through all of its API keys; None: no limit.
    max_jobs_in_flight_per_owner: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings, *, remember_live_models: bool = False) -> AdmissionPolicy:
        grace, always = settings.worker_restart_grace_s, tuple(settings.scale_to_zero_models)
        live = LiveModels(settings.worker_stale_after_s, grace_s=grace, always=always) if remember_live_models else None
        cooldowns = CrashCooldowns(
            settings.engine_crash_limit, settings.engine_crash_window_s, settings.engine_crash_cooldown_s
        )
        return cls(
            settings.worker_stale_after_s,
            settings.max_jobs_in_flight_per_key,
            live,
            grace,
            cooldowns,
            always,
            settings.trust_domains,
            settings.max_jobs_in_flight_per_owner,
        )


def require_served(session: Session, policy: AdmissionPolicy, model_key: str, engine: EngineKind | None = None) -> None:
    """Return if some worker serves ``model_key`` (live, or within the restart grace) with an ``engine`` (any
    when None), else raise :class:`ModelNotServed` naming the served models, or :class:`EngineNotServed`."""
    live = policy.live_models or LiveModels(
        policy.stale_after_s, max_age_s=0, grace_s=policy.restart_grace_s, always=policy.scale_to_zero_models
    )
    engines = live.engines(session, model_key)
    if not engines:
        served = ", ".join(repr(key) for key in sorted(live.read(session))) or "none"
        raise ModelNotServed(f"no live worker serves model {model_key!r}; live models: {served}")
    if engine is not None and engine.value not in engines:
        kinds = " and a ".join(sorted(engines))
        raise EngineNotServed(f"model {model_key!r} is served here by a {kinds} engine, not {engine.value}", engines)


def refuse_if_full(in_flight: int, limit: int, owner_in_flight: int = 0, owner_limit: int | None = None) -> None:
    """Raise :class:`TooManyJobsInFlight` if an API key with ``in_flight`` jobs queued or running is at ``limit``,
    or its owner, with ``owner_in_flight`` through all its keys, at ``owner_limit``. The counts themselves are part
    of the statement that adds the job (:mod:`nnqueue.scheduler.intake`)."""
    if in_flight >= limit:
        raise TooManyJobsInFlight(
            f"this API key already has {in_flight} jobs queued or running; the limit is {limit} "
            "(NNQUEUE_MAX_JOBS_IN_FLIGHT_PER_KEY): wait for some to finish"
        )
    if owner_limit is not None and owner_in_flight >= owner_limit:
        raise TooManyJobsInFlight(
            f"this API key's owner already has {owner_in_flight} jobs queued or running through its keys; the limit"
            f" is {owner_limit} (NNQUEUE_MAX_JOBS_IN_FLIGHT_PER_OWNER): wait for some to finish"
        )
