"""Run the Alembic migrations shipped in this package (``nnqueue/db/migrations``) on a database URL; check that one is current.

The migrations are package data, found through the package's own path, so an installed wheel migrates
its database exactly as a source checkout does.

Upgrading first repairs one stamp of the past: the ``purged_at`` migration was revision ``0006``, applied after
``0003`` (commit fa0e90b), until it was renumbered ``0004`` (6bf6d92), the numbers following the order they
apply in. A database migrated by a checkout between the two, before ``job_payloads`` came (old ``0005``), is
stamped ``0006`` while it holds only ``0004``'s change; under today's numbering ``0006`` means that ``0005``
(``job_payloads``) and ``0006`` (``workers.engine``) ran too, so a plain upgrade would skip both. Such a stamp
is recognised by the schema (``jobs.purged_at`` there, ``job_payloads`` not) and set back to ``0004``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import make_url

from nnqueue.db.session import make_engine
from nnqueue.errors import NNqueueError

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic migrations not found at {MIGRATIONS_DIR}: this nnqueue install is incomplete; reinstall it"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Alembic's Config interpolates '%'; a password may contain one.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


log = logging.getLogger(__name__)

# The stamp a checkout between the two numberings of the purged_at migration left, and the revision it meant.
OLD_PURGED_AT_STAMP, PURGED_AT = "0006", "0004"


def upgrade(database_url: str, revision: str = "head") -> None:
    repair_old_stamp(database_url)
    command.upgrade(alembic_config(database_url), revision)


def repair_old_stamp(database_url: str) -> bool:
    """Re-stamp a database stamped by the old numbering of the ``purged_at`` migration (see the module) to
    ``0004``, so that an upgrade runs what it lacks; whether it did."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            if MigrationContext.configure(connection).get_current_revision() != OLD_PURGED_AT_STAMP:
                return False
            schema = inspect(connection)
            tables = set(schema.get_table_names())
            if "job_payloads" in tables or "purged_at" not in {column["name"] for column in schema.get_columns("jobs")}:
                return False
    finally:
        engine.dispose()
    log.warning(
        "the database is stamped %s by the old numbering of the purged_at migration (it holds %s's change, not "
        "0005's nor 0006's): re-stamping it %s so that the upgrade runs them",
        OLD_PURGED_AT_STAMP,
        PURGED_AT,
        PURGED_AT,
    )
    command.stamp(alembic_config(database_url), PURGED_AT, purge=True)
    return True


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


class SchemaOutOfDate(NNqueueError, RuntimeError):
    """The database is not migrated to the revision this code needs."""


def require_head(database_url: str) -> None:
    """Raise :class:`SchemaOutOfDate`, saying what to run, unless the database is at the newest revision."""
    config = alembic_config(database_url)
    head = ScriptDirectory.from_config(config).get_current_head()
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
    if current != head:
        raise SchemaOutOfDate(
            f"the database at {make_url(database_url).render_as_string(hide_password=True)} is at revision "
            f"{current or 'none (no nnqueue tables)'}, but this nnqueue needs {head}: run `nnqueue db upgrade`"
        )
