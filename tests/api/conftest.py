"""API tests: ``create_app`` on the suite's real Postgres, Redis and S3, called through FastAPI's TestClient.

Each module gets its own service namespace (a fresh migrated database, a Redis database number and an
S3 bucket): the ``services`` fixture. Jobs are submitted for models that "live" workers serve: real worker
rows, registered and kept fresh through :mod:`nnqueue.scheduler.registry`; only ``test_results.py`` uses a
real worker process, the session's shared one (it is marked ``shared_worker``: its namespace is the shared one). The
helpers are in tests/utils/api.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.utils.api import Api, api_client
from tests.utils.services import Services


@pytest.fixture(scope="module")
def api(services: Services) -> Iterator[Api]:
    # Registered worker rows stay live for the whole module (tests of staleness make their own app).
    with api_client(services, worker_stale_after_s=3600) as client:
        yield client
