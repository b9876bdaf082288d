"""The Alembic migrations build exactly the ORM's schema, on real Postgres and on SQLite, and undo cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from nnqueue.db import migrate
from nnqueue.db.models import Base
from nnqueue.db.session import make_engine

TABLES = {
    "api_keys",
    "jobs",
    "job_events",
    "job_payloads",
    "workers",
    "status_sessions",
    "harvests",
    "harvest_chunks",
    "harvest_schedules",
    "weights_updates",
    "domain_members",
    "alembic_version",
}


EXPRESSION_INDEXES = {"ix_jobs_queued_order"}


def _drift(url: str) -> list:
    engine = make_engine(url)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata)
        dialect = connection.dialect.name
    engine.dispose()
    if dialect == "sqlite":  # alembic compares expression indexes (a DESC column) only approximately there and
        # reports them as removed and added; on PostgreSQL they are compared exactly
        diff = [op for op in diff if not (op[0] in ("add_index", "remove_index") and op[1].name in EXPRESSION_INDEXES)]
    return diff


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    names = set(inspect(engine).get_table_names())
    engine.dispose()
    return names


@pytest.fixture(params=["postgres", "sqlite"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'nnqueue.db'}"
    return request.getfixturevalue("empty_postgres_url")


def test_upgrade_head_matches_models_then_downgrade_base_removes_everything(empty_database_url: str) -> None:
    assert _tables(empty_database_url) == set()

    migrate.upgrade(empty_database_url)
    assert _tables(empty_database_url) == TABLES
    assert _drift(empty_database_url) == []

    migrate.downgrade(empty_database_url, "base")
    assert _tables(empty_database_url) == {"alembic_version"}


def test_drift_is_detected_when_models_and_migrations_disagree(empty_postgres_url: str) -> None:
    # Guards the no-drift assertion above: it must be able to fail.
    migrate.upgrade(empty_postgres_url)
    migrate.downgrade(empty_postgres_url, "base")
    assert any(op[0] == "add_table" for op in _drift(empty_postgres_url))


def test_upgrade_repairs_the_stamp_of_the_old_purged_at_numbering(empty_database_url: str) -> None:
    """A checkout between the two numberings of the purged_at migration (0006, then 0004) stamped 0006 after
    running it; upgrading must still run today's 0005 (job_payloads) and 0006 (workers.engine)."""
    migrate.upgrade(empty_database_url, "0004")  # 0001-0003 and the purged_at migration, as that checkout ran them
    command.stamp(migrate.alembic_config(empty_database_url), "0006", purge=True)  # the stamp it left
    assert "job_payloads" not in _tables(empty_database_url)

    migrate.upgrade(empty_database_url)

    assert _tables(empty_database_url) == TABLES
    assert _drift(empty_database_url) == []
    migrate.require_head(empty_database_url)


def test_a_database_at_todays_0006_is_not_restamped(empty_database_url: str) -> None:
    migrate.upgrade(empty_database_url, "0006")
    assert not migrate.repair_old_stamp(empty_database_url)
    migrate.upgrade(empty_database_url)
    assert _drift(empty_database_url) == []
