"""``/v1/schedules``: recurring harvests (a cron expression and a harvest spec), fired by ``nnqueue beat``.

Create, list, show, pause, resume and delete; each caller sees only their own schedules (404 otherwise)
unless the key has the ``admin`` scope; creating one needs the ``harvest`` scope (a default key's), the other routes ``harvest`` or ``admin``.
The spec is checked as a harvest's would be when it fires, not now (its files may not exist yet); a bad
cron expression is a 422 at once, a dataset outside the caller's prefix a 403, a key over its schedules 429. Each change is one transaction on the request's session.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from nnqueue.api.deps import Caller, HarvestCallerDep, HarvestReaderDep, SessionDep, SettingsDep
from nnqueue.api.ownership import owned_or_404
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import ScheduleCreate, ScheduleListResponse, ScheduleResponse
from nnqueue.db.models import HarvestSchedule
from nnqueue.scheduler.harvest_spec import HarvestRejected
from nnqueue.scheduler.schedules import create_schedule, set_paused

router = APIRouter(prefix="/v1/schedules", tags=["schedules"], route_class=ReleasingRoute)
NOT_YOURS: dict[int | str, dict[str, Any]] = {404: {"description": "No such schedule, or another owner's."}}


@router.post("", status_code=status.HTTP_201_CREATED)
def create(
    body: ScheduleCreate, caller: HarvestCallerDep, session: SessionDep, settings: SettingsDep
) -> ScheduleResponse:
    """Create a schedule: 422 for a bad cron expression, 403 for a dataset outside the caller's prefix, 429 over
    NNQUEUE_MAX_SCHEDULES_PER_KEY."""
    try:
        schedule = create_schedule(
            session,
            owner=caller.owner,
            api_key_id=caller.key_id,
            name=body.name,
            cron=body.cron,
            spec=body.spec,
            max_per_key=settings.max_schedules_per_key,
        )
    except HarvestRejected as rejected:
        raise HTTPException(rejected.status, rejected.reason) from None
    response = ScheduleResponse.of(schedule)
    session.commit()
    return response


@router.get("", responses={403: {"description": "`owner` names another owner and the key is not an admin."}})
def list_schedules(
    caller: HarvestReaderDep,
    session: SessionDep,
    owner: Annotated[
        str | None, Query(description="Only this owner's schedules (admins; others may name only themselves).")
    ] = None,
) -> ScheduleListResponse:
    """The caller's schedules (an admin's: every owner's)."""
    query = select(HarvestSchedule).order_by(HarvestSchedule.id)
    if (listed := caller.listed_owner(owner)) is not None:
        query = query.where(HarvestSchedule.owner == listed)
    schedules = session.scalars(query)
    return ScheduleListResponse(schedules=[ScheduleResponse.of(schedule) for schedule in schedules])


@router.get("/{schedule_id}", responses=NOT_YOURS)
def get_schedule(schedule_id: int, caller: HarvestReaderDep, session: SessionDep) -> ScheduleResponse:
    return ScheduleResponse.of(owned_or_404(session, HarvestSchedule, schedule_id, caller))


@router.post("/{schedule_id}/pause", responses=NOT_YOURS)
def pause(schedule_id: int, caller: HarvestReaderDep, session: SessionDep) -> ScheduleResponse:
    return _set_paused(session, schedule_id, caller, True)


@router.post("/{schedule_id}/resume", responses=NOT_YOURS)
def resume(schedule_id: int, caller: HarvestReaderDep, session: SessionDep) -> ScheduleResponse:
    return _set_paused(session, schedule_id, caller, False)


@router.delete("/{schedule_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_YOURS)
def delete(schedule_id: int, caller: HarvestReaderDep, session: SessionDep) -> None:
    """Delete the schedule; harvests it already started go on."""
    session.delete(owned_or_404(session, HarvestSchedule, schedule_id, caller, for_update=True))
    session.commit()


def _set_paused(session: Session, schedule_id: int, caller: Caller, paused: bool) -> ScheduleResponse:
    schedule = owned_or_404(session, HarvestSchedule, schedule_id, caller, for_update=True)
    set_paused(session, schedule, paused)
    response = ScheduleResponse.of(schedule)
    session.commit()
    return response
