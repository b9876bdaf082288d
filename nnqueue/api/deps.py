"""FastAPI dependencies: the process's shared resources and the authenticated caller.

:func:`nnqueue.api.app.create_app` builds the resources once and keeps them on ``app.state``
(:class:`Resources`); routes receive them through the ``Annotated`` aliases below, so tests can
build an app on their own settings and nothing reads global state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from celery import Celery
from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.api.auth import AuthenticationFailed, authenticate
from nnqueue.settings import Settings
from nnqueue.storage.object_store import ObjectStore


@dataclass(frozen=True)
class Resources:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: ObjectStore
    celery: Celery


@dataclass(frozen=True)
class Caller:
    """Who is calling: the owner whose jobs they may see, and the key they used."""

    owner: str
    key_id: int


def get_resources(request: Request) -> Resources:
    return request.app.state.resources


def get_settings(resources: Annotated[Resources, Depends(get_resources)]) -> Settings:
    return resources.settings


def get_sessions(resources: Annotated[Resources, Depends(get_resources)]) -> sessionmaker[Session]:
    return resources.sessions


async def get_session(sessions: Annotated[sessionmaker[Session], Depends(get_sessions)]) -> AsyncIterator[Session]:
    """One session per request, closed (its transaction rolled back) when the route function returns:
    before the response is sent, so a streamed download does not hold a database connection.

    Opened and closed on the event loop, not in a worker thread: a request must never hold a connection while
    it waits for a thread (all threads could then be waiting for connections: a deadlock). Opening does no I/O;
    closing gives the connection back to the pool.
    """
    with sessions() as session:
        yield session


def get_store(resources: Annotated[Resources, Depends(get_resources)]) -> ObjectStore:
    return resources.store


def get_celery(resources: Annotated[Resources, Depends(get_resources)]) -> Celery:
    return resources.celery


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
StoreDep = Annotated[ObjectStore, Depends(get_store)]
CeleryDep = Annotated[Celery, Depends(get_celery)]


_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`")
# nnsight's own remote clients send their key in this header.
_ndif_header = APIKeyHeader(name="ndif-api-key", auto_error=False, description="`ndif-api-key: <key>`")


def get_caller(
    session: SessionDep,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ndif_key: Annotated[str | None, Security(_ndif_header)],
) -> Caller:
    secret = bearer.credentials if bearer is not None else ndif_key
    if not secret:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>' or 'ndif-api-key: <key>'")
    try:
        key = authenticate(session, secret)
    except AuthenticationFailed as failure:
        raise _unauthorized(str(failure)) from None
    finally:
        # Give the connection back before the route runs, in another thread: a request holding one while it waits
        # for a thread could starve the threads that hold none, each waiting for a connection (a deadlock).
        session.commit()
    return Caller(owner=key.owner, key_id=key.id)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


CallerDep = Annotated[Caller, Depends(get_caller)]
