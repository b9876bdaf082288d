"""Rows by the first characters of their id: ``6286`` or ``62862211-8`` names every row whose UUID starts with
those hex digits (dashes are ignored), so a person can type an id's start, as with git's commits.

A prefix is a range of UUIDs, from the prefix padded with zeros to the prefix padded with ``f``: the filter is a
range on the primary key, which Postgres' ``uuid`` and SQLite's 32-digit hex text (SQLAlchemy's ``Uuid``) both
order as the hex digits read.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from sqlalchemy import ColumnElement

HEX_DIGITS = re.compile(r"[0-9a-f]{1,32}")


def id_range(prefix: str) -> tuple[uuid.UUID, uuid.UUID]:
    """The first and last UUID that start with ``prefix``; ``ValueError`` if it is not the start of one."""
    digits = prefix.replace("-", "").lower()
    if not HEX_DIGITS.fullmatch(digits):
        raise ValueError(f"{prefix!r} is not the start of an id: 1 to 32 hex digits, dashes allowed")
    return uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))


def starting_with(column: Any, prefix: str) -> ColumnElement[bool]:
    """The filter for the rows whose UUID ``column`` starts with ``prefix`` (see `id_range`)."""
    low, high = id_range(prefix)
    return column.between(low, high)
