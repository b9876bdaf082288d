"""Database engines and sessions, for Postgres (production) and SQLite (embedded default)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Engine, Update, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from sqlalchemy.engine import CursorResult

# Database connections each process may hold (the most SQLAlchemy's default pool opened: 5 plus 10 overflow).
POOL_SIZE = 15


def make_engine(url: str) -> Engine:
    """An engine for ``url``. For SQLite, creates the file's folder (mode 0700) and the file (mode 0600: it holds
    every job and the keys' hashes; SQLite gives its -wal and -shm files the same mode) and turns on WAL and
    foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # Up to POOL_SIZE connections, kept once opened, and no overflow: SQLAlchemy's default (5, plus 10 opened
        # and closed again as demand comes and goes) had the API's 40 threads open a new connection, a Postgres
        # process, for every few requests under load. A thread finding all of them busy waits for one.
        return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=0)
    if parsed.database and parsed.database != ":memory:":
        private_file(Path(parsed.database))
    # The API, the worker and the CLI share the embedded SQLite file: wait for locks, don't fail.
    engine = create_engine(url, connect_args={"timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def private_file(path: Path) -> None:
    """``path`` made (empty) if missing, in folders made with mode 0700, and mode 0600 when this process owns it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    if path.stat().st_uid == os.geteuid() and path.stat().st_mode & 0o077:
        path.chmod(0o600)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose work is committed on success and rolled back on any exception."""
    with factory() as session, session.begin():
        yield session


def updated(session: Session, statement: Update) -> int:
    """Run an UPDATE (without synchronising the session's objects) and return how many rows it changed: the
    result of a compare-and-set, whose guards are in its WHERE clause."""
    result = session.execute(statement.execution_options(synchronize_session=False))
    return cast("CursorResult[Any]", result).rowcount
