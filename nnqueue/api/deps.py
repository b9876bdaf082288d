"""FastAPI dependencies: the process's shared resources and the authenticated caller.

:func:`nnqueue.api.app.create_app` builds the resources once and keeps them on ``app.state``
(:class:`Resources`); routes receive them through the ``Annotated`` aliases below, so tests can
build an app on their own settings and nothing reads global state. Dependencies that do no I/O are
``async``: FastAPI would otherwise run each in a worker thread, a hop per dependency per request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from celery import Celery
from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.api.auth import AuthenticationFailed, authenticate, hash_secret
from nnqueue.scheduler.admission import AdmissionPolicy
from nnqueue.settings import Settings
from nnqueue.storage.object_store import ObjectStore


@dataclass(frozen=True)
class Resources:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    store: ObjectStore
    celery: Celery
    admission: AdmissionPolicy
    callers: RecentCallers


@dataclass(frozen=True)
class Caller:
    """Who is calling: the owner whose jobs they may see, the key they used and its scopes."""

    owner: str
    key_id: int
    scopes: frozenset[str] = frozenset()

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def may_see(self, owner: str) -> bool:
        """Whether this caller may see and act on what ``owner`` owns: their own, or anyone's for an admin."""
        return owner == self.owner or self.is_admin

    def listed_owner(self, owner: str | None) -> str | None:
        """The owner a listing filters on (None: every owner, an admin's default); 403 unless the caller may
        list ``owner``'s (only an admin may name another owner)."""
        if owner is not None and owner != self.owner:
            check_scope(self, "admin")
        return owner if owner is not None or self.is_admin else self.owner


async def get_resources(request: Request) -> Resources:
    return request.app.state.resources


async def get_settings(resources: Annotated[Resources, Depends(get_resources)]) -> Settings:
    return resources.settings


async def get_sessions(resources: Annotated[Resources, Depends(get_resources)]) -> sessionmaker[Session]:
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


async def get_store(resources: Annotated[Resources, Depends(get_resources)]) -> ObjectStore:
    return resources.store


async def get_celery(resources: Annotated[Resources, Depends(get_resources)]) -> Celery:
    return resources.celery


ResourcesDep = Annotated[Resources, Depends(get_resources)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
StoreDep = Annotated[ObjectStore, Depends(get_store)]
CeleryDep = Annotated[Celery, Depends(get_celery)]


_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`")
# nnsight's own remote clients send their key in this header.
_ndif_header = APIKeyHeader(name="ndif-api-key", auto_error=False, description="`ndif-api-key: <key>`")


async def get_caller(
    resources: Annotated[Resources, Depends(get_resources)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ndif_key: Annotated[str | None, Security(_ndif_header)],
) -> Caller:
    """The key's owner (:func:`caller_of`)."""
    return await caller_of(resources, bearer.credentials if bearer is not None else ndif_key)


async def caller_of(resources: Resources, secret: str | None) -> Caller:
    """The owner of the key ``secret``, or 401. A key found valid is remembered for NNQUEUE_AUTH_CACHE_S (no
    database round trip, no worker thread); a revoked key is therefore refused within that time."""
    if not secret:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <key>' or 'ndif-api-key: <key>'")
    caller = resources.callers.get(secret)
    if caller is None:
        try:
            caller = await run_in_threadpool(_look_up, resources.sessions, secret)
        except AuthenticationFailed as failure:
            raise _unauthorized(str(failure)) from None
        resources.callers.put(secret, caller)
    return caller


def _look_up(sessions: sessionmaker[Session], secret: str) -> Caller:
    with sessions() as session:
        key = authenticate(session, secret)
        return Caller(owner=key.owner, key_id=key.id, scopes=frozenset(key.scopes))


class RecentCallers:
    """Keys found valid in the last ``ttl_s`` seconds, by their secret's hash (at most ``limit`` of them)."""

    def __init__(self, ttl_s: float, limit: int = 10_000) -> None:
        self.ttl_s, self.limit = ttl_s, limit
        self._entries: dict[str, tuple[float, Caller]] = {}

    def get(self, secret: str) -> Caller | None:
        entry = self._entries.get(hash_secret(secret))
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, secret: str, caller: Caller) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[hash_secret(secret)] = (time.monotonic() + self.ttl_s, caller)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


CallerDep = Annotated[Caller, Depends(get_caller)]

SCOPE_PURPOSE = {
    "trace": "submit traces (they run arbitrary code on the workers)",
    "harvest": "submit harvests and steering jobs, and keep harvest schedules",
    "admin": "act on other owners' jobs, harvests and schedules, and swap models' checkpoints",
    "weights": "drive a worker's trainer endpoints (generate, push weights)",
}


def check_scope(caller: Caller, scope: str) -> None:
    """403, with the reason, unless the caller's key has ``scope``."""
    if scope not in caller.scopes:
        held = ", ".join(sorted(caller.scopes)) or "none"
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"this API key lacks the {scope!r} scope, needed to {SCOPE_PURPOSE[scope]} (its scopes: {held});"
            f" an operator grants it with: nnqueue keys scopes <key id> --scope {scope}",
        )


def require_scope(scope: str) -> Callable[[Caller], Coroutine[Any, Any, Caller]]:
    """A dependency giving the caller, or 403 if its key lacks ``scope``: ``Depends(require_scope("harvest"))``."""

    async def caller_with_scope(caller: CallerDep) -> Caller:
        check_scope(caller, scope)
        return caller

    return caller_with_scope


# The caller of a route that queues code (a trace): 403 unless its key has the ``trace`` scope.
TraceCallerDep = Annotated[Caller, Depends(require_scope("trace"))]
# The caller of the routes that submit harvests or create schedules (declarative specs, no code): 403 unless
# its key has ``harvest``.
HarvestCallerDep = Annotated[Caller, Depends(require_scope("harvest"))]
# The caller of the routes that change a model's weights (checkpoint swaps): 403 unless its key has ``admin``.
AdminCallerDep = Annotated[Caller, Depends(require_scope("admin"))]


async def harvest_reader(caller: CallerDep) -> Caller:
    """The caller of the harvest and schedule routes that read, cancel, pause or delete: a ``harvest`` key, or an
    ``admin``'s (which acts on every owner's)."""
    if not caller.is_admin:
        check_scope(caller, "harvest")
    return caller


HarvestReaderDep = Annotated[Caller, Depends(harvest_reader)]
