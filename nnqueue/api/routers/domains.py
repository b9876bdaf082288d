"""``/v1/domains``: trust domains (:mod:`nnqueue.scheduler.trust_domains`). Any key reads its own domain and who is in
it; a key with the ``admin`` scope sees every group and moves owners into and out of groups (the operator's CLI does
the same: ``nnqueue domains``). An owner's queued jobs move with them; running ones finish where they are."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, status
from sqlalchemy.orm import Session

from nnqueue.api.deps import AdminCallerDep, CallerDep, SessionDep, SettingsDep
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.schemas import DomainChange, DomainsResponse, OwnerDomain
from nnqueue.scheduler.trust_domains import (
    InvalidDomain,
    Mode,
    UnknownOwner,
    domain_of,
    groups,
    join_group,
    leave_group,
)

router = APIRouter(prefix="/v1/domains", tags=["domains"], route_class=ReleasingRoute)
CHANGES: dict[int | str, dict[str, Any]] = {
    403: {"description": "The key lacks the admin scope."},
    404: {"description": "No API key has this owner."},
}


@router.get("")
def my_domain(caller: CallerDep, session: SessionDep, settings: SettingsDep) -> DomainsResponse:
    """The caller's trust domain and its owners; with the admin scope, every named group too."""
    domain = domain_of(session, caller.owner, settings.trust_domains)
    mine = groups(session, caller.owner).get(domain, [caller.owner])
    return DomainsResponse(
        mode=settings.trust_domains,
        domain=domain,
        members=mine if settings.trust_domains == "owner" else [],  # the deployment: everyone
        groups=groups(session) if caller.is_admin else None,
    )


@router.put("/owners/{owner}", responses={**CHANGES, 422: {"description": "Not a group's name."}})
def join(
    owner: str, body: DomainChange, _caller: AdminCallerDep, session: SessionDep, settings: SettingsDep
) -> OwnerDomain:
    """Put ``owner`` in the group ``domain`` (made by its first owner), with their queued jobs: their traces share
    engines with the group's owners' from now on."""
    try:
        moved = join_group(session, owner, body.domain, settings.trust_domains)
    except (InvalidDomain, UnknownOwner) as refused:
        raise _refusal(refused) from None
    return _changed(session, owner, settings.trust_domains, moved)


@router.delete("/owners/{owner}", responses=CHANGES)
def leave(owner: str, _caller: AdminCallerDep, session: SessionDep, settings: SettingsDep) -> OwnerDomain:
    """Put ``owner`` back in a domain of their own (the default), with their queued jobs."""
    try:
        moved = leave_group(session, owner, settings.trust_domains)
    except UnknownOwner as refused:
        raise _refusal(refused) from None
    return _changed(session, owner, settings.trust_domains, moved)


def _refusal(refused: InvalidDomain | UnknownOwner) -> HTTPException:
    code = status.HTTP_404_NOT_FOUND if isinstance(refused, UnknownOwner) else status.HTTP_422_UNPROCESSABLE_CONTENT
    return HTTPException(code, str(refused))


def _changed(session: Session, owner: str, mode: Mode, moved: int) -> OwnerDomain:
    session.commit()
    return OwnerDomain(owner=owner, domain=domain_of(session, owner, mode), moved_jobs=moved)
