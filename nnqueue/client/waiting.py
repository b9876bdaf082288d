"""Waiting for a job or a harvest to end: one polling loop for both.

The loop asks the API for the latest state until it is final, backing off from ``FIRST_POLL_S`` to
``MAX_POLL_S`` while nothing changes (status, queue position, progress), and rides out transient poll
failures: up to ``MAX_POLL_FAILURES`` in a row where the API could not be reached or answered 5xx (a
restarting API, a proxy's 502). A definite answer (a 4xx) ends the wait at once, and so does ``timeout``
(:class:`~nnqueue.client.errors.WaitTimeout`; the job itself goes on).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from nnqueue.client.errors import APIConnectionError, APIError, Followed, WaitTimeout

# The statuses a job or harvest never leaves.
TERMINAL = frozenset({"completed", "failed", "cancelled"})
# Polling backs off from the first to the last interval while nothing changes.
FIRST_POLL_S = 0.2
MAX_POLL_S = 2.0
# Consecutive failed polls (API unreachable or 5xx) a wait tolerates before it gives up.
MAX_POLL_FAILURES = 10


class Pollable(Followed, Protocol):
    """A job or a harvest: ``info`` is the API's last answer about it, ``refresh`` asks again."""

    def refresh(self) -> object: ...


def wait_until_ended(
    followed: Pollable,
    timeout: float | None,
    show: Callable[[dict[str, Any]], None],
    *,
    poll_interval: float | None = None,
) -> None:
    """Refresh ``followed`` until its status is final, calling ``show`` with each answer; see the module."""
    deadline = None if timeout is None else time.monotonic() + timeout
    first = poll_interval or FIRST_POLL_S
    longest = poll_interval or MAX_POLL_S
    interval, failures, last_seen = first, 0, None
    while True:
        try:
            followed.refresh()
            failures = 0
        except (APIConnectionError, APIError) as error:
            transient = isinstance(error, APIConnectionError) or error.status_code >= 500
            failures += 1
            if not transient or failures > MAX_POLL_FAILURES:
                raise
        show(followed.info)
        if followed.info.get("status") in TERMINAL:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(followed, timeout or 0.0)
        info = followed.info
        seen = (info.get("status"), info.get("queue_position"), str(info.get("progress")))
        interval = first if seen != last_seen else min(interval * 1.5, longest)
        last_seen = seen
        time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
