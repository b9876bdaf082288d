"""nnsight's requests as nnqueue jobs: submitting one, following it to its end, and its result URL.

Shared by the ``remote=True`` routes (:mod:`nnqueue.api.routers.ndif`) and the ``serve=`` routes
(:mod:`nnqueue.api.routers.ndif_serve`). A job is submitted through ``submit_job`` like any other (admission,
payload, row, queue), after the checks of :mod:`nnqueue.api.nnsight_protocol`. :func:`follow` waits on the
:class:`~nnqueue.api.job_watch.JobWatcher` until the job ends, and ends it itself when nothing else will:
a client that leaves cancels its job (nobody can receive its result), and a job whose model has had no live
worker for ``NNQUEUE_WORKER_RESTART_GRACE_S`` (:func:`orphan_grace_s`: time for a crashed worker to come back)
is cancelled, so that a waiting client always hears COMPLETED or ERROR.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.api import nnsight_protocol as protocol
from nnqueue.api.deps import Caller, Resources
from nnqueue.api.job_watch import JobWatcher, Seen
from nnqueue.db.lifecycle import InvalidTransition, JobNotFound, transition
from nnqueue.db.models import ENDED, Job, JobKind, JobStatus
from nnqueue.db.session import transaction
from nnqueue.scheduler.admission import EngineNotServed
from nnqueue.scheduler.submission import accept_job, queue_job
from nnqueue.settings import Settings
from nnqueue.storage.object_store import ObjectStore, PresignUnsupported


@dataclass(frozen=True)
class NnsightRequest:
    """One request of an nnsight client, as it arrived."""

    nnsight_key: str | None  # nnsight's model key (remote=True); None when the URL names the model (serve=)
    model_key: str | None  # nnqueue's model key, from the serve= URL
    blob: bytes
    compress: bool
    env: dict[str, Any]
    versions: dict[str, str] | None
    protocol: str  # "remote" or "serve"


def submit_nnsight(
    resources: Resources, caller: Caller, request: NnsightRequest, job_id: uuid.UUID | None = None
) -> Job:
    """Check and submit the request, in one transaction (admission checks the model is served by the engine
    the trace needs); raises :class:`~nnqueue.api.nnsight_protocol.ProtocolError` and admission's refusals
    (:mod:`nnqueue.api.refusals` answers them) without storing anything when it cannot run here."""
    settings = resources.settings
    if request.nnsight_key is not None:
        target = protocol.resolve_model(request.nnsight_key)
    else:
        target = protocol.Target(request.model_key or "", protocol.EngineKind.VLLM, "VLLM")
    payload = protocol.decompress(request.blob, request.compress, settings.max_payload_bytes)
    protocol.check_runnable(target, protocol.tracer_class(payload))
    meta: dict[str, Any] = {
        "metadata": {},
        "ndif": {
            "protocol": request.protocol,
            "compress": request.compress,
            "env": protocol.check_env(target, request.env),
            "url_key": protocol.new_signing_key(),
        },
    }
    if request.versions is not None:
        meta["client"] = request.versions
    with transaction(resources.sessions) as session:
        if job_id is not None and session.get(Job, job_id) is not None:
            raise protocol.SessionTaken("a request was already sent for this session id; subscribe again for a new one")
        try:
            accepted = accept_job(
                session,
                resources.store,
                admission=resources.admission,
                inline_payload_max_bytes=settings.inline_payload_max_bytes,
                owner=caller.owner,
                api_key_id=caller.key_id,
                model_key=target.model_key,
                payload=payload,
                kind=JobKind.TRACE,
                timeout_s=settings.default_job_timeout_s,
                meta=meta,
                job_id=job_id,
                engine=target.engine,
            )
        except EngineNotServed as refused:
            raise protocol.ProtocolError(
                f"model {target.model_key!r} is served here by a {' and a '.join(sorted(refused.engines))} engine, "
                f"which cannot run nnsight {target.what} traces: those need a {target.engine.value} engine"
                f" (nnqueue worker --engine {target.engine.value})"
            ) from None
    queue_job(resources.sessions, resources.celery, accepted.job)
    return accepted.job


def orphan_grace_s(settings: Settings) -> float:
    """How long a followed job may wait with no live worker for its model before it is cancelled: the restart
    grace (a crashed worker comes back meanwhile), and never less than the silence that marks a worker dead."""
    return max(settings.worker_stale_after_s, settings.worker_restart_grace_s)


async def follow(
    watcher: JobWatcher,
    sessions: sessionmaker[Session],
    job_id: uuid.UUID,
    *,
    orphan_grace_s: float,
    left: Callable[[], Awaitable[bool]],
    arrival_timeout_s: float | None = None,
) -> AsyncIterator[Seen | None]:
    """Yield the job each time it is read, until it has ended (the last item) or the client ``left()``.

    Yields None while the job does not exist yet, until ``arrival_timeout_s`` (then stops). A client that
    left gets its job cancelled; a job whose model has had no live worker for ``orphan_grace_s`` is
    cancelled with a reason, and its CANCELLED state is the last item.
    """
    started = time.monotonic()
    orphaned_since: float | None = None
    with watcher.watching(job_id):
        while True:
            await watcher.next_poll()
            seen = watcher.seen(job_id)
            if await left():
                if seen is not None and seen.job.status not in ENDED:
                    await asyncio.to_thread(_cancel, sessions, job_id, "the nnsight client disconnected")
                return
            if seen is None:
                if arrival_timeout_s is not None and time.monotonic() - started > arrival_timeout_s:
                    return
                yield None
                continue
            if seen.job.status in ENDED:
                yield seen
                return
            if seen.model_live:
                orphaned_since = None
            elif orphaned_since is None:
                orphaned_since = time.monotonic()
            elif time.monotonic() - orphaned_since > orphan_grace_s:
                reason = f"no live worker has served model {seen.job.model_key!r} for {orphan_grace_s:g} s"
                ended = await asyncio.to_thread(_cancel, sessions, job_id, reason)
                if ended is not None:
                    yield Seen(ended, None, False)
                    return
            yield seen


def _cancel(sessions: sessionmaker[Session], job_id: uuid.UUID, reason: str) -> Job | None:
    """Cancel the job, recording why (its error message says it to the client); None if it ended meanwhile."""
    try:
        with transaction(sessions) as session:
            return transition(
                session,
                job_id,
                JobStatus.CANCELLED,
                detail={"by": "nnqueue", "reason": reason},
                error_type="JobCancelled",
                error_message=f"job {job_id} was cancelled: {reason}",
            )
    except (InvalidTransition, JobNotFound):
        return None


def result_url(base_url: str, store: ObjectStore, sessions: sessionmaker[Session], settings: Settings, job: Job) -> str:
    """A URL that downloads ``job``'s result without credentials until ``NNQUEUE_RESULT_URL_EXPIRY_S`` passes:
    the store's presigned URL when the client takes the bytes as stored, else the API's signed route (which
    compresses them as the client asked)."""
    assert job.result_key is not None
    ndif = job.meta.get("ndif") if isinstance(job.meta, dict) else None
    compress = bool(ndif.get("compress")) if isinstance(ndif, dict) else False
    if not compress:
        try:
            return store.presigned_get_url(job.result_key, settings.result_url_expiry_s)
        except PresignUnsupported:
            pass
    key = protocol.signing_key(job) or _add_signing_key(sessions, job)
    expires = int(time.time()) + settings.result_url_expiry_s
    signature = protocol.sign_result(key, job.id, expires, compress)
    return f"{base_url.rstrip('/')}/ndif/result/{job.id}?expires={expires}&compress={int(compress)}&sig={signature}"


def _add_signing_key(sessions: sessionmaker[Session], job: Job) -> str:
    """A signing key for a job submitted another way (an nnqueue client's job polled through nnsight's client)."""
    key = protocol.new_signing_key()
    meta = dict(job.meta) if isinstance(job.meta, dict) else {}
    meta["ndif"] = {**(meta.get("ndif") or {}), "url_key": key}
    with transaction(sessions) as session:
        session.execute(update(Job).where(Job.id == job.id).values(meta=meta))
    job.meta = meta
    return key
