"""Answers to bad requests that always encode: no 5xx for anything a client can send.

FastAPI's own validation-error handler echoes the offending input, and Starlette's ``JSONResponse``
refuses to encode ``NaN``, ``Infinity`` or undecodable bytes: a spec holding ``NaN`` turned a 422 into
a 500 (and a dropped keep-alive connection). Here every error body goes through :func:`json_safe`,
which keeps what JSON can hold and writes the rest as text. The database is the other source: text
columns cannot hold NUL characters, so a value with one that reaches a query is refused as a 422
(:func:`refuse_database_value`) rather than surfacing as the driver's error. And when the database
or the object store cannot be reached, or the store fails a request (a full disk, a revoked credential), the
answer is a 503 that says which (:func:`unavailable`), not a bare 500: the request may be sent again.
"""

from __future__ import annotations

import math
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as their names and bytes as text, so ``json.dumps`` cannot fail."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="backslashreplace")
    if isinstance(value, dict):
        return {str(json_safe(key)): json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(item) for item in value]
    return value


async def validation_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    errors = jsonable_encoder(json_safe(list(error.errors())), custom_encoder={bytes: json_safe})
    return JSONResponse({"detail": json_safe(errors)}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


async def refuse_database_value(_request: Request, error: Exception) -> JSONResponse:
    """The database refused a value from the request (a NUL character in a text field, say)."""
    reason = str(getattr(error, "orig", error)).splitlines()[0]
    return JSONResponse(
        {"detail": f"a value in the request cannot be stored or searched for: {reason}"},
        status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
    )


async def unavailable(_request: Request, error: Exception) -> JSONResponse:
    what = "the database" if isinstance(error, DBAPIError) else "the object store"
    failed = "failed the request" if isinstance(error, ClientError) else "is unreachable"
    reason = str(getattr(error, "orig", error)).splitlines()[0][:300]
    return JSONResponse(
        {"detail": f"{what} {failed}; try again later ({type(error).__name__}: {reason})"},
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
    )


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(DataError, refuse_database_value)
    for unreachable in (OperationalError, InterfaceError, BotoCoreError, ClientError):
        app.add_exception_handler(unreachable, unavailable)
