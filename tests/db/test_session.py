"""The Postgres engine keeps the connections it opened: many threads using it at once (the API's 40) open at most
``POOL_SIZE`` of them, once, rather than a new connection (a Postgres process) for every few requests."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import event, text

from nnqueue.db.session import POOL_SIZE, make_engine


def test_forty_threads_share_the_pool_without_opening_connections_per_request(
    database_factory: Callable[..., str],
) -> None:
    engine = make_engine(database_factory(migrated=False))
    opened: list[Any] = []
    event.listen(engine, "connect", lambda connection, _record: opened.append(connection))

    def request(_: int) -> None:  # a query, then work without the database (a request's parsing, a send)
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        time.sleep(0.002)

    with ThreadPoolExecutor(40) as threads:
        list(threads.map(request, range(2000)))
    engine.dispose()
    assert 1 <= len(opened) <= POOL_SIZE
