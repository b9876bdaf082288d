"""Recurring harvests: a cron expression (croniter) and a spec; each time it comes due, a new harvest run.

``nnqueue beat`` (:mod:`nnqueue.scheduler.beat`) calls :func:`fire_due` every ``NNQUEUE_BEAT_INTERVAL_S``. Schedules live in the database
(the ``harvest_schedules`` table), so the API lists, pauses, resumes and deletes them with no beat restart,
and several beat processes may run: a run is claimed by moving the schedule's ``next_run_at`` forward with a
compare-and-set, so each due time fires once. A due time missed while no beat ran fires once, not once
per missed time. A run that cannot be created (its model has no live worker, its files are gone) is
recorded as the schedule's ``last_error``; the schedule stays and fires again at its next time.
"""

from __future__ import annotations

import logging
from datetime import datetime

from celery import Celery
from croniter import croniter
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import HarvestSchedule, utcnow
from nnqueue.db.session import transaction, updated
from nnqueue.scheduler.harvest_dataset import Limits, check_readable
from nnqueue.scheduler.harvest_spec import HarvestRejected, HarvestSpec
from nnqueue.scheduler.harvests import Submission, create_harvest
from nnqueue.storage.object_store import ObjectStore

log = logging.getLogger(__name__)


def next_time(cron: str, after: datetime) -> datetime:
    """The first time ``cron`` names after ``after``; raises :class:`HarvestRejected` (422) for a bad expression."""
    if not croniter.is_valid(cron, second_at_beginning=False):
        raise HarvestRejected(422, f"{cron!r} is not a cron expression (five or six fields, e.g. '0 3 * * *')")
    return croniter(cron, after).get_next(datetime)


def create_schedule(
    session: Session,
    *,
    owner: str,
    api_key_id: int | None,
    name: str,
    cron: str,
    spec: HarvestSpec,
    max_per_key: int | None = None,
) -> HarvestSchedule:
    """Add a schedule to the caller's transaction (the caller commits); raises :class:`HarvestRejected`: 422 for a
    bad cron expression or a dataset without a source (a schedule uploads no file), 403 for a dataset outside the
    owner's prefix, 429 when the key already keeps ``max_per_key`` schedules. The rest of the spec is checked
    against the world when it fires, not now (its files may not exist yet, its model's workers may not run)."""
    if spec.dataset.inline is None and spec.dataset.path is None and spec.dataset.prefix is None:
        raise HarvestRejected(422, "a schedule's dataset needs a source: prompts, token_ids, path or prefix")
    check_readable(spec.dataset, owner)
    if max_per_key is not None and api_key_id is not None:
        kept = session.scalar(
            select(func.count()).select_from(HarvestSchedule).where(HarvestSchedule.api_key_id == api_key_id)
        )
        if (kept or 0) >= max_per_key:
            raise HarvestRejected(
                429,
                f"this API key already keeps {kept} schedules; the limit is {max_per_key} "
                "(NNQUEUE_MAX_SCHEDULES_PER_KEY): delete one first",
            )
    schedule = HarvestSchedule(
        owner=owner,
        api_key_id=api_key_id,
        name=name,
        cron=cron,
        spec=spec.model_dump(mode="json"),
        paused=False,
        next_run_at=next_time(cron, utcnow()),
        runs=0,
    )
    session.add(schedule)
    session.flush()
    return schedule


def set_paused(session: Session, schedule: HarvestSchedule, paused: bool) -> None:
    """Pause or resume ``schedule`` (read with ``FOR UPDATE`` in the caller's transaction); a resumed schedule next
    fires at its next time from now (missed ones are skipped). The caller commits."""
    if schedule.paused and not paused:
        schedule.next_run_at = next_time(schedule.cron, utcnow())
    schedule.paused = paused
    session.flush()


def fire_due(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    app: Celery,
    *,
    limits: Limits,
    stale_after_s: float,
    restart_grace_s: float = 0.0,
    scale_to_zero_models: tuple[str, ...] = (),
    now: datetime | None = None,
) -> list[int]:
    """Create a harvest for each unpaused schedule that is due; returns the schedules that fired. The model
    must be served as for a submission (``Submission``'s ``restart_grace_s`` and ``scale_to_zero_models``)."""
    now = now or utcnow()
    with sessions() as session:
        due = list(
            session.scalars(
                select(HarvestSchedule).where(HarvestSchedule.paused.is_(False), HarvestSchedule.next_run_at <= now)
            )
        )
    fired = []
    for schedule in due:
        if not _claim_run(sessions, schedule, now):
            continue  # another beat fired it, or it was paused or deleted meanwhile
        fired.append(schedule.id)
        fields: dict[str, object] = {"last_run_at": now, "runs": HarvestSchedule.runs + 1}
        try:
            submission = Submission(
                owner=schedule.owner,
                limits=limits,
                stale_after_s=stale_after_s,
                api_key_id=schedule.api_key_id,
                schedule_id=schedule.id,
                restart_grace_s=restart_grace_s,
                scale_to_zero_models=scale_to_zero_models,
            )
            harvest = create_harvest(sessions, store, app, HarvestSpec.model_validate(schedule.spec), submission)
            fields.update(last_harvest_id=harvest.id, last_error=None)
            log.info("schedule %s (%s) started harvest %s", schedule.id, schedule.name, harvest.id)
        except HarvestRejected as rejected:
            fields["last_error"] = f"{rejected.status}: {rejected.reason}"
            log.warning("schedule %s (%s) could not start a run: %s", schedule.id, schedule.name, rejected.reason)
        with transaction(sessions) as session:
            session.execute(update(HarvestSchedule).where(HarvestSchedule.id == schedule.id).values(**fields))
    return fired


def _claim_run(sessions: sessionmaker[Session], schedule: HarvestSchedule, now: datetime) -> bool:
    with transaction(sessions) as session:
        moved = updated(
            session,
            update(HarvestSchedule)
            .where(
                HarvestSchedule.id == schedule.id,
                HarvestSchedule.paused.is_(False),
                HarvestSchedule.next_run_at == schedule.next_run_at,
            )
            .values(next_run_at=next_time(schedule.cron, now)),
        )
        return moved == 1
