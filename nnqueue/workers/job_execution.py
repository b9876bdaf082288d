"""Running one job on the worker's engine: claim it, rebuild its trace, run it, store its result.

The database decides whether a delivered task may run (:func:`claim`): a message can arrive twice
(a worker died, or Redis's visibility timeout passed), and only the delivery that moves the job to
RUNNING runs it. Every outcome is a status change with its cause: COMPLETED with the result's key,
or FAILED with the error's type, message and the user's traceback. A cancel is seen by
:meth:`JobRunner.reap_lost`, which the heartbeat calls; it aborts the job's vLLM requests, as it does for a
job requeued while this worker looked dead. A worker finishes (and writes the result of) only a job it
still holds.

Database and object-store calls run in threads (``asyncio.to_thread``) so that the engine loop keeps
serving the other jobs; the trace *build* runs on the loop itself, without an await, because builds
must not interleave (see :mod:`nnqueue.engines.trace_runner`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import platform
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import nnsight
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import InvalidTransition, transition
from nnqueue.db.models import Job, JobStatus
from nnqueue.db.session import transaction
from nnqueue.engines import trace_runner
from nnqueue.errors import NNqueueError
from nnqueue.scheduler.claim import claim
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore
from nnqueue.storage.results import write_result

log = logging.getLogger(__name__)
S = JobStatus


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # another delivery owns the job, or it had already ended


@dataclass
class JobFailure(NNqueueError):
    type_name: str
    message: str
    traceback: str = ""


@dataclass
class JobRunner:
    sessions: sessionmaker[Session]
    store: ObjectStore
    model: Any  # a dispatched async nnsight VLLM
    worker_id: str
    stale_after_s: float
    _running: dict[uuid.UUID, asyncio.Task[Any]] = field(default_factory=dict)
    # Running jobs this worker stopped, and why: CANCELLED by a user, or SKIPPED (taken by another worker).
    _aborted: dict[uuid.UUID, Outcome] = field(default_factory=dict)

    async def run(self, job_id: uuid.UUID) -> Outcome:
        job = await asyncio.to_thread(claim, self.sessions, job_id, self.worker_id, self.stale_after_s)
        if job is None:
            log.info("job %s skipped: another delivery owns it, or it has ended", job_id)
            return Outcome.SKIPPED
        task = asyncio.current_task()
        assert task is not None
        self._running[job_id] = task
        try:
            saves, invokes = await asyncio.wait_for(self._execute(job), timeout=job.timeout_s)
            if not await asyncio.to_thread(self._holds, job_id):
                # Taken from us (requeued while this worker looked dead) or cancelled: the result
                # key is the job's, so writing it could overwrite the other holder's result.
                log.info("job %s no longer held by this worker; its result is dropped", job_id)
                return Outcome.SKIPPED
            stored = await asyncio.to_thread(write_result, self.store, job_id, saves)
            return await self._finish(
                job_id,
                S.COMPLETED,
                {"result_bytes": stored.size},
                result_key=stored.key,
                result_size=stored.size,
                result_format=stored.format,
                progress_done=invokes,
            )
        except asyncio.CancelledError:
            if job_id not in self._aborted:
                raise  # the worker is shutting down; the message is redelivered
            outcome = self._aborted[job_id]
            why = "cancelled" if outcome is Outcome.CANCELLED else "taken over by another worker"
            log.info("job %s %s; its requests were aborted", job_id, why)
            return outcome  # its status is the canceller's or the new holder's
        except TimeoutError:
            failure = JobFailure("JobTimeout", f"job exceeded its timeout of {job.timeout_s:g} s and was aborted")
            return await self._fail(job_id, failure)
        except JobFailure as failure:
            return await self._fail(job_id, failure)
        except Exception as error:  # our side failed (object store, engine): say so, don't hang
            log.exception("job %s failed in the worker", job_id)
            return await self._fail(job_id, JobFailure(type(error).__name__, str(error), traceback.format_exc()))
        finally:
            self._running.pop(job_id, None)
            self._aborted.pop(job_id, None)

    async def _execute(self, job: Job) -> tuple[dict[str, Any], int]:
        """The job's saves and its number of invokes, or raises :class:`JobFailure`."""
        try:
            payload = await asyncio.to_thread(self.store.get_bytes, job.payload_key)
        except ObjectNotFound:
            raise JobFailure(
                "PayloadMissing", f"the job's payload {job.payload_key} is not in the object store"
            ) from None
        try:
            # No await between here and the submit: builds must not interleave.
            built = trace_runner.build_trace(self.model, payload, f"{job.id}-{job.attempts}")
        except Exception as error:  # a payload fails to rebuild in any way; the job fails with it
            raise JobFailure(type(error).__name__, _build_error_message(error, job), traceback.format_exc()) from error
        await asyncio.to_thread(self._set_total, job.id, len(built.request_ids))
        result = await trace_runner.run_trace(self.model, built)
        if result.error is not None and not result.error.get("is_control_flow"):
            raise JobFailure(
                result.error.get("type_name", "Exception"),
                result.error.get("message", ""),
                result.error.get("traceback", ""),
            )
        return result.saves, len(built.request_ids)

    async def _finish(self, job_id: uuid.UUID, target: JobStatus, detail: dict[str, Any], **fields: Any) -> Outcome:
        try:
            await asyncio.to_thread(_transition, self.sessions, job_id, target, detail, self.worker_id, fields)
        except InvalidTransition as lost:
            # Cancelled or taken over while finishing: the other writer's status stands.
            log.info("job %s not marked %s: %s", job_id, target.value, lost)
            return Outcome.CANCELLED if lost.current is S.CANCELLED else Outcome.SKIPPED
        return Outcome(target.value)

    async def _fail(self, job_id: uuid.UUID, failure: JobFailure) -> Outcome:
        return await self._finish(
            job_id,
            S.FAILED,
            {"error": failure.type_name},
            error_type=failure.type_name,
            error_message=failure.message,
            error_traceback=failure.traceback,
        )

    def _set_total(self, job_id: uuid.UUID, total: int) -> None:
        with transaction(self.sessions) as session:
            session.execute(update(Job).where(Job.id == job_id).values(progress_total=total))

    def running_jobs(self) -> list[uuid.UUID]:
        return list(self._running)

    def reap_lost(self) -> list[uuid.UUID]:
        """Abort the running jobs this worker no longer holds: CANCELLED by their owner, or requeued
        (and maybe claimed by another worker) while this one looked dead. Call from any thread but the loop's."""
        running = self.running_jobs()
        if not running:
            return []
        with self.sessions() as session:
            rows = session.execute(select(Job.id, Job.status, Job.worker_id).where(Job.id.in_(running))).all()
        lost = [(job_id, status) for job_id, status, holder in rows if not self._held(status, holder)]
        for job_id, status in lost:
            self._aborted[job_id] = Outcome.CANCELLED if status is S.CANCELLED else Outcome.SKIPPED
            task = self._running.get(job_id)
            if task is not None:
                # Cancelling the task cancels its vLLM generate streams, which aborts the requests.
                task.get_loop().call_soon_threadsafe(task.cancel)
        return [job_id for job_id, _ in lost]

    def _held(self, status: JobStatus, holder: str | None) -> bool:
        return status is S.RUNNING and holder == self.worker_id

    def _holds(self, job_id: uuid.UUID) -> bool:
        with self.sessions() as session:
            row = session.execute(select(Job.status, Job.worker_id).where(Job.id == job_id)).first()
        return row is not None and self._held(*row)


def _transition(
    sessions: sessionmaker[Session],
    job_id: uuid.UUID,
    target: JobStatus,
    detail: dict[str, Any],
    worker_id: str,
    fields: dict[str, Any],
) -> None:
    with transaction(sessions) as session:
        transition(session, job_id, target, detail=detail, held_by=worker_id, **fields)


def _build_error_message(error: Exception, job: Job) -> str:
    """The build error, with both sides' versions when the client's differ from the server's."""
    client = job.meta.get("client", {}) if isinstance(job.meta, dict) else {}
    server = {"nnsight": nnsight.__version__, "python": platform.python_version()}
    message = f"could not rebuild the trace: {error}"
    if client and any(client.get(name) != version for name, version in server.items()):
        message += (
            f" (client nnsight {client.get('nnsight', '?')} / python {client.get('python', '?')},"
            f" server nnsight {server['nnsight']} / python {server['python']})"
        )
    return message
