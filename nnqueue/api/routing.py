"""The API's route class: routes that give their database connection back before FastAPI moves on to another
worker thread, and that read JSON bodies strictly.

FastAPI runs each synchronous dependency, the route function and the response's validation as separate hops
to its thread pool (40 threads). A request that still held a pooled connection between two hops could wait
for a thread while every thread waited for a connection: with more concurrent requests than threads and
connections, the API stalled and answered 500 after the pool's 30 s timeout. So a route's session is closed
(its connection returned) in the route's own thread, as soon as the route function returns; routes build
their response bodies before that, and the ORM objects they hold stay readable (``expire_on_commit=False``).

JSON bodies are read by :func:`strict_loads`: Python's parser takes ``NaN`` and ``Infinity``, which JSON has
not, and a spec holding one was stored with the value silently turned into null (or refused by the database as
a 500). Here it is a 422 that names the constant, on every route (the form fields holding JSON use the same parser).
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

from nnqueue.errors import NNqueueError


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` with a ``JSONDecodeError`` naming it."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except _NotJSON as error:
        document = text if isinstance(text, str) else text.decode("utf-8", errors="replace")
        raise json.JSONDecodeError(str(error), document, 0) from None


class _NotJSON(NNqueueError, ValueError):
    """A JSON text names a constant JSON does not have; turned into a ``JSONDecodeError`` by ``strict_loads``."""


def _refuse_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not JSON")


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_loads(await self.body())
        return self._json


class ReleasingRoute(APIRoute):
    """An APIRoute whose synchronous endpoint closes the sessions it was given before it returns."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _closing_sessions(endpoint)
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_json(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_json


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
