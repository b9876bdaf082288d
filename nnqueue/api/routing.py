"""API routes that give their database connection back before FastAPI moves on to another worker thread.

FastAPI runs each synchronous dependency, the route function and the response's validation as separate hops
to its thread pool (40 threads). A request that still held a pooled connection between two hops could wait
for a thread while every thread waited for a connection: with more concurrent requests than threads and
connections, the API stalled and answered 500 after the pool's 30 s timeout. So a route's session is closed
(its connection returned) in the route's own thread, as soon as the route function returns; routes build
their response bodies before that, and the ORM objects they hold stay readable (``expire_on_commit=False``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi.routing import APIRoute
from sqlalchemy.orm import Session


class ReleasingRoute(APIRoute):
    """An APIRoute whose synchronous endpoint closes the sessions it was given before it returns."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _closing_sessions(endpoint)
        super().__init__(path, endpoint, **kwargs)


def _closing_sessions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    return run
