"""Cursor pagination of job listings, newest first, and the ``id_prefix`` filter of every listing.

A cursor names the last job of a page by ``(created_at, id)``, and the next page holds the jobs
strictly older in that order. Jobs submitted meanwhile are newer than every cursor, so they never
shift later pages: no job is repeated or skipped while a client pages through.

``id_prefix`` keeps the rows whose id starts with it (:mod:`nnqueue.db.ids`): the client reads a job's, harvest's
or steering job's first characters as its id through it, when exactly one of the caller's starts with them.
"""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime
from typing import Annotated

from fastapi import Query
from pydantic import AfterValidator
from sqlalchemy import ColumnElement, and_, or_

from nnqueue.db.ids import id_range
from nnqueue.db.models import Job
from nnqueue.errors import NNqueueError


class InvalidCursor(NNqueueError, ValueError):
    pass


def encode_cursor(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), str(job.id)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def older_than(cursor: str) -> ColumnElement[bool]:
    """The filter for the jobs after ``cursor`` in newest-first order; raises :class:`InvalidCursor`."""
    try:
        created_text, id_text = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        created_at, job_id = datetime.fromisoformat(created_text), uuid.UUID(id_text)
    except (ValueError, TypeError) as error:
        raise InvalidCursor("not a cursor from a previous page's next_cursor") from error
    return or_(Job.created_at < created_at, and_(Job.created_at == created_at, Job.id < job_id))


NEWEST_FIRST = (Job.created_at.desc(), Job.id.desc())


def _checked_prefix(prefix: str | None) -> str | None:
    if prefix is not None:
        id_range(prefix)  # its ValueError is the 422's reason
    return prefix


IdPrefixQuery = Annotated[
    str | None,
    Query(max_length=36, description="Only the ids that start with these characters (hex digits; dashes ignored)."),
    AfterValidator(_checked_prefix),
]
