"""Owned or 404: every route that names one job, harvest or schedule reads it through :func:`owned_or_404`.

A row that does not exist and a row of another owner answer the same 404 (``no job <id>``), so ids cannot be
probed; an admin sees every owner's. Who may see what is the viewer's to say (:meth:`Caller.may_see
<nnqueue.api.deps.Caller.may_see>` for a key, the status page's signed-in viewer likewise).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from fastapi import HTTPException, status
from sqlalchemy.orm import Session

from nnqueue.db.models import Harvest, HarvestSchedule, Job


class Viewer(Protocol):
    def may_see(self, owner: str) -> bool: ...


Owned = TypeVar("Owned", Job, Harvest, HarvestSchedule)
NOUNS: dict[type[Any], str] = {Job: "job", Harvest: "harvest", HarvestSchedule: "schedule"}


def owned_or_404(
    session: Session, kind: type[Owned], ident: object, viewer: Viewer, *, for_update: bool = False
) -> Owned:
    """The row of ``kind`` with this id, freshly read (locked with ``for_update``), if ``viewer`` may see it;
    else 404 ``no <noun> <id>``."""
    row = session.get(kind, ident, populate_existing=True, with_for_update=for_update)
    if row is None or not viewer.may_see(row.owner):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no {NOUNS[kind]} {ident}")
    return row
