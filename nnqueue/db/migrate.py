"""Run the Alembic migrations shipped in this package (``nnqueue/db/migrations``) on a database URL; check that one is current.

The migrations are package data, found through the package's own path, so an installed wheel migrates
its database exactly as a source checkout does."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
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


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


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
