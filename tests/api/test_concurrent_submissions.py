"""Many clients submitting at once to one API process all get their answer: none waits forever for a database
connection that another request holds while it waits for a thread (they did, and got 500 after 30 s)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from nnqueue.settings import Settings
from tests.utils.api import LIVE_MODEL, create_secret, register_worker, served
from tests.utils.payloads import fake_trace
from tests.utils.services import Services

CLIENTS = 96  # more than the API's thread pool (40) and its connection pool (15) together


def test_more_clients_than_threads_and_connections_all_get_201(services: Services) -> None:
    register_worker(services.sessions)
    headers = {"Authorization": f"Bearer {create_secret(services.sessions, 'crowd')}"}
    settings = Settings(
        _env_file=None,
        **{**services.settings.model_dump(), "worker_stale_after_s": 3600, "max_jobs_in_flight_per_key": 10_000},
    )

    async def crowd(url: str) -> list[int]:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=120) as client:

            async def submit() -> int:
                spec = json.dumps({"model_key": LIVE_MODEL})
                response = await client.post(
                    "/v1/jobs", data={"spec": spec}, files={"payload": ("t", fake_trace(b"p"))}
                )
                return response.status_code

            return await asyncio.gather(*(submit() for _ in range(CLIENTS)))

    with served(settings) as url:
        started = time.monotonic()
        statuses = asyncio.run(crowd(url))
        elapsed = time.monotonic() - started
    assert statuses == [201] * CLIENTS
    assert elapsed < 25, f"{CLIENTS} submissions took {elapsed:.0f} s: requests waited on each other"
