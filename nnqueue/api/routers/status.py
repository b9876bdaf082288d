"""``/status``: a server-rendered status page for browsers (Jinja2, no JavaScript at all).

Signing in: the viewer pastes an API key into a form; the server opens a session (a ``status_sessions`` row:
the sha256 of a random session id, the key, when it ends) and the cookie holds the session id, never the key.
The cookie is ``HttpOnly`` (no script can read it), ``SameSite=Strict`` (no other site's page can make the
browser send it), ``Secure`` when the page was served over HTTPS, and scoped to ``Path=/status`` (the JSON API
under ``/v1`` never accepts it, so it cannot be used to submit or cancel). A session lasts
``NNQUEUE_STATUS_SESSION_S``; signing out deletes it on the server, and the key is checked again on every
request, so revoking it ends its sessions. Keys never appear in URLs (which end up in logs and browser history). POSTs must come from this page (their ``Origin``, when sent, must be this host),
and every page forbids framing and scripts through its Content-Security-Policy.

Result downloads go through ``/status/jobs/<id>/result``, authenticated by the same cookie.
"""

from __future__ import annotations

import secrets
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, Form, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from nnqueue.api.auth import AuthenticationFailed, authenticate, hash_secret
from nnqueue.api.deps import SessionDep, SettingsDep, StoreDep
from nnqueue.api.ownership import owned_or_404
from nnqueue.api.routers.jobs import result_response
from nnqueue.api.routing import ReleasingRoute
from nnqueue.api.status_view import ADMIN_SCOPE, Viewer, status_view
from nnqueue.db.models import ApiKey, Job, JobStatus, StatusSession, utcnow

router = APIRouter(prefix="/status", include_in_schema=False, route_class=ReleasingRoute)
COOKIE = "nnqueue_status"
REFRESH_S = 10
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _since(moment: datetime | None, now: datetime) -> str:
    return "" if moment is None else _age((now - moment).total_seconds())


def _size(count: int | None) -> str:
    if count is None:
        return ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


templates = Jinja2Templates(directory=Path(__file__).resolve().parent.parent / "templates")
templates.env.filters.update(age=_age, since=_since, size=_size)


def _viewer(request: Request, session: Session) -> Viewer | None:
    """The signed-in viewer: the live key of the cookie's session, if the session has not ended."""
    session_id = request.cookies.get(COOKIE)
    if not session_id:
        return None
    key = session.scalar(
        select(ApiKey)
        .join(StatusSession, StatusSession.api_key_id == ApiKey.id)
        .where(StatusSession.id_hash == hash_secret(session_id), StatusSession.expires_at > utcnow())
        .where(ApiKey.revoked_at.is_(None))
    )
    if key is None:
        return None
    return Viewer(owner=key.owner, key_prefix=key.key_prefix, is_admin=ADMIN_SCOPE in (key.scopes or []))


def _open_session(session: Session, key: ApiKey, lifetime_s: int) -> str:
    """A new session of ``key`` for ``lifetime_s``, and its id (only its hash is stored); ended ones are deleted."""
    now = utcnow()
    session.execute(delete(StatusSession).where(StatusSession.expires_at <= now))
    session_id = secrets.token_urlsafe(32)
    expires = now + timedelta(seconds=lifetime_s)
    session.add(StatusSession(id_hash=hash_secret(session_id), api_key_id=key.id, created_at=now, expires_at=expires))
    session.commit()
    return session_id


def _page(request: Request, template: str, status_code: int = 200, **context: object) -> HTMLResponse:
    response = templates.TemplateResponse(request, template, context, status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    return response


def _same_origin(request: Request) -> None:
    """Refuse a form posted from another site (the cookie is SameSite=Strict; this also covers sign-in)."""
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-site form posts are refused")


def _to_sign_in() -> RedirectResponse:
    return RedirectResponse("/status/sign-in", status_code=status.HTTP_303_SEE_OTHER)


@router.get("", response_class=HTMLResponse)
def status_page(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    status_filter: Annotated[JobStatus | None, Query(alias="status")] = None,
) -> Response:
    viewer = _viewer(request, session)
    if viewer is None:
        return _to_sign_in()
    view = status_view(session, viewer, settings.worker_stale_after_s, status_filter, settings.trust_domains)
    return _page(request, "status.html", view=view, refresh_s=REFRESH_S, statuses=list(JobStatus))


@router.get("/sign-in", response_class=HTMLResponse)
def sign_in_form(request: Request) -> Response:
    return _page(request, "sign_in.html")


@router.post("/sign-in", response_class=HTMLResponse)
def sign_in(
    request: Request, session: SessionDep, settings: SettingsDep, key: Annotated[str, Form(max_length=200)]
) -> Response:
    _same_origin(request)
    try:
        api_key = authenticate(session, key.strip())
    except AuthenticationFailed as failure:
        return _page(request, "sign_in.html", status.HTTP_401_UNAUTHORIZED, error=str(failure))
    response = RedirectResponse("/status", status_code=status.HTTP_303_SEE_OTHER)
    response.set_cookie(
        COOKIE,
        _open_session(session, api_key, settings.status_session_s),
        max_age=settings.status_session_s,
        path="/status",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


@router.post("/sign-out")
def sign_out(request: Request, session: SessionDep) -> Response:
    """End the session on the server (its cookie, if kept or copied, opens nothing) and drop the cookie."""
    _same_origin(request)
    if session_id := request.cookies.get(COOKIE):
        session.execute(delete(StatusSession).where(StatusSession.id_hash == hash_secret(session_id)))
        session.commit()
    response = _to_sign_in()
    response.delete_cookie(COOKIE, path="/status", httponly=True, samesite="strict")
    return response


@router.get("/jobs/{job_id}/result")
def download(
    request: Request,
    job_id: uuid.UUID,
    session: SessionDep,
    settings: SettingsDep,
    store: StoreDep,
    format: Literal["torch", "safetensors"] = "torch",  # noqa: A002 - the query parameter's name
) -> Response:
    """A job's result for a signed-in viewer (its owner, or an admin)."""
    viewer = _viewer(request, session)
    if viewer is None:
        return _to_sign_in()
    return result_response(owned_or_404(session, Job, job_id, viewer), format, store, settings)
