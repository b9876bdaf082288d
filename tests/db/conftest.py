"""An empty Postgres database per test, for schema tests that migrate it themselves."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def empty_postgres_url(database_factory: Callable[..., str]) -> str:
    return database_factory(migrated=False)
