"""Client tests: the real API (uvicorn on a free port, in a thread: ``api_server``, with ``secret`` and ``client``
from tests/conftest.py) on the suite's Postgres, Redis and S3, with one real ``nnqueue worker`` process for the
tiny model (``start_worker``).

Each module gets its own service namespace (``services``: its own database, Redis database and bucket).
Results live in S3 (SeaweedFS, which checks signatures), so result downloads follow the API's redirect
to a presigned URL unless a test asks for ``inline``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.utils.services import WorkerProcess


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return start_worker(max_concurrent_jobs=4)
