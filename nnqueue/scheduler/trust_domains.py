"""Trust domains: which owners' traces may share an engine.

A ``trace`` runs its owner's Python inside the engine, and no allow-list inside that process is a boundary (issue
33): a trace can change what later traces on the same engine compute. So owners belong to a trust domain, and an
engine runs the traces of one domain at a time (:mod:`nnqueue.scheduler.domain_turns`); harvests and steering jobs
run no user code and go to any engine. The domains:

* ``owner:<owner>``: the owner alone, the shipped default (``NNQUEUE_TRUST_DOMAINS=owner``): secure by default.
* a named group (``lab``, ``team-a``): owners an admin put together because they trust each other
  (``nnqueue domains join``, ``PUT /v1/domains/owners/{owner}``): their traces share engines, so a domain switch
  is not paid between them.
* ``deployment``: everyone (``NNQUEUE_TRUST_DOMAINS=deployment``), for a single researcher's box or a team that
  trusts each other entirely; groups are then moot (kept for when the setting goes back).

A job records its owner's domain when it is accepted (:func:`domain_of`, or the same lookup inside the statement
that adds it on Postgres: :func:`grouped_domain`). Moving an owner into or out of a group moves their queued jobs
too, in the same transaction; their running jobs finish where they started. Changing ``NNQUEUE_TRUST_DOMAINS``
applies to jobs accepted afterwards.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from sqlalchemy import ColumnElement, delete, exists, func, literal, select, update
from sqlalchemy.orm import Session

from nnqueue.db.models import ApiKey, DomainMember, HarvestChunk, Job, JobStatus, utcnow
from nnqueue.errors import NNqueueError

Mode = Literal["owner", "deployment"]
OWN_PREFIX = "owner:"
DEPLOYMENT = "deployment"
OTHER = "other"  # what listings call a domain the viewer is not in (:func:`shown`)
# A group's name: letters, digits, '.', '_' and '-', at most 64; never an owner's own domain, "deployment" or "other".
GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


# A job's domain in SQL: its recorded one; a row without one (added around the API) is in its owner's own.
job_domain = func.coalesce(Job.domain, literal(OWN_PREFIX) + Job.owner)


def job_domain_of(job: Job) -> str:
    """:data:`job_domain` of a loaded job: the domain it was accepted in (its owner's own, for rows older than
    domains), whose code a trace runs."""
    return job.domain or own_domain(job.owner)


class InvalidDomain(NNqueueError, ValueError):
    """A group name that is not one (its form, or a reserved name)."""


class UnknownOwner(NNqueueError, LookupError):
    """No API key has this owner: a typo would otherwise group nobody."""


def shown(domain: str, viewer_domain: str, is_admin: bool) -> str:
    """``domain`` as a listing shows it to a viewer in ``viewer_domain``: "other" for another owner's own domain or
    another group (who runs what is theirs to know), unless the viewer is an admin."""
    return domain if is_admin or domain in (viewer_domain, DEPLOYMENT) else OTHER


def own_domain(owner: str) -> str:
    """The domain an owner is alone in."""
    return OWN_PREFIX + owner


def default_domain(owner: str, mode: Mode) -> str:
    """The domain ``owner``'s jobs are in unless an admin grouped the owner: their own, or the deployment's."""
    return DEPLOYMENT if mode == DEPLOYMENT else own_domain(owner)


def check_group_name(name: str) -> str:
    """``name`` if it may name a group, else :class:`InvalidDomain` saying why."""
    if name == DEPLOYMENT:
        raise InvalidDomain(f"{DEPLOYMENT!r} is the whole deployment's domain (NNQUEUE_TRUST_DOMAINS=deployment)")
    if name == OTHER:
        raise InvalidDomain(f"{OTHER!r} is what listings call the domains a viewer is not in")
    if not GROUP_NAME.fullmatch(name):
        raise InvalidDomain(
            f"{name!r} cannot name a trust domain: use 1 to 64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (an owner's own domain needs no name: leave the group instead)"
        )
    return name


def domain_of(session: Session, owner: str, mode: Mode) -> str:
    """The domain ``owner``'s jobs run in now."""
    if mode == DEPLOYMENT:
        return DEPLOYMENT
    group = session.scalar(select(DomainMember.domain).where(DomainMember.owner == owner))
    return group or own_domain(owner)


def grouped_domain(owner: ColumnElement[Any], default: ColumnElement[Any]) -> ColumnElement[Any]:
    """SQL for :func:`domain_of` inside another statement: ``owner``'s group, else ``default`` (pass a null owner
    where groups do not apply: the deployment's domain)."""
    group = select(DomainMember.domain).where(DomainMember.owner == owner).scalar_subquery()
    return func.coalesce(group, default)


def chunk_domain() -> ColumnElement[Any]:
    """A harvest chunk's domain in SQL: its owner's now (harvests record none; they matter to domain turns only
    with ``NNQUEUE_TRUST_DOMAINS=owner``, where a worker's turns cover them: :mod:`nnqueue.scheduler.domain_turns`)."""
    owner = HarvestChunk.__table__.c.owner
    return grouped_domain(owner, literal(OWN_PREFIX) + owner)


def join_group(session: Session, owner: str, group: str, mode: Mode) -> int:
    """Put ``owner`` in ``group`` (out of any other), and their queued jobs with them; returns how many moved.
    Raises :class:`InvalidDomain` or :class:`UnknownOwner`. The caller commits."""
    check_group_name(group)
    _require_owner(session, owner)
    member = session.get(DomainMember, owner)
    if member is None:
        session.add(DomainMember(owner=owner, domain=group, updated_at=utcnow()))
    else:
        member.domain, member.updated_at = group, utcnow()
    session.flush()
    return _move_queued(session, owner, group if mode != DEPLOYMENT else DEPLOYMENT)


def leave_group(session: Session, owner: str, mode: Mode) -> int:
    """Put ``owner`` back in a domain of their own (their queued jobs too); returns how many jobs moved. The caller
    commits."""
    _require_owner(session, owner)
    session.execute(delete(DomainMember).where(DomainMember.owner == owner))
    return _move_queued(session, owner, default_domain(owner, mode))


def groups(session: Session, owner: str | None = None) -> dict[str, list[str]]:
    """Each named group and its owners, sorted; with ``owner``, only the group ``owner`` is in (if any)."""
    query = select(DomainMember.domain, DomainMember.owner).order_by(DomainMember.domain, DomainMember.owner)
    if owner is not None:
        query = query.where(
            DomainMember.domain == select(DomainMember.domain).where(DomainMember.owner == owner).scalar_subquery()
        )
    members: dict[str, list[str]] = {}
    for domain, member in session.execute(query):
        members.setdefault(domain, []).append(member)
    return members


def _require_owner(session: Session, owner: str) -> None:
    if not session.scalar(select(exists().where(ApiKey.owner == owner))):
        raise UnknownOwner(f"no API key has owner {owner!r} (nnqueue keys list shows the owners)")


def _move_queued(session: Session, owner: str, domain: str) -> int:
    moved = session.execute(
        update(Job)
        .where(Job.owner == owner, Job.status == JobStatus.QUEUED, Job.domain != domain)
        .values(domain=domain)
        .execution_options(synchronize_session=False)
    )
    return int(moved.rowcount)  # type: ignore[attr-defined]
