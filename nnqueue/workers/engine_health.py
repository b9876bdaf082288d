"""A dead engine heals: the job that killed it fails, the others run again, a fresh engine serves.

When vLLM's engine core dies (an exception in a forward that no request could absorb, the process
killed), every request on it ends with ``EngineDeadError`` and the engine never serves again. The
first job to see that calls :meth:`EngineHealth.engine_died`, which, once for the whole worker:

1. stops this worker taking work: later tokens are sent again, unclaimed, for another worker;
2. reads the engine's crash report (:mod:`nnqueue.enginecore.crash_report`): the jobs in the fatal step;
3. settles the jobs this worker holds. A job alone in the fatal step crashed the engine: it fails with
   the engine's error, worded by the report's cause (`blame`): its own code raised it, vLLM's code failed
   on what its trace gave it, or the host's set-up failed (a permission, a module outside the job's code,
   torch's compiler), which is said not to be the job's doing; or the worker killed the engine to stop its
   stalled code (``InterventionStalled``, :mod:`nnqueue.workers.stall_deadline`). Jobs in a fatal step with
   others cannot be told apart: each is requeued marked ``run_alone`` with its crash count in
   ``job.meta["engine_crashes"]``, so that next time it runs with no other job on its engine
   (:class:`EngineGate`) and, if it is the culprit, is the only job in the step it kills. A job that has crashed an engine :data:`MAX_ENGINE_CRASHES` times fails whatever the
   report says (an engine killed without a report, by the OOM killer say, names no step). Jobs that
   were not in the fatal step are requeued as they were;
4. starts a fresh engine in this worker process (``restart``: :mod:`nnqueue.workers.engine_restart`): the jobs
   that come meanwhile wait for it (:meth:`EngineHealth.restarted`) and then run on it. A worker with no in-process
   restart (the transformers engine, a TRL trainer's), or whose restart fails, deregisters and stops instead (a warm
   Celery shutdown), which then exits with :data:`EXIT_ENGINE_DIED`: the supervisor
   (:mod:`nnqueue.workers.supervisor`) starts a fresh worker.

Each engine is a generation (:attr:`EngineHealth.generation`): a job that started on an engine that has since been
replaced and only now sees its death was settled with that engine's jobs, and starts nothing.

A live engine is replaced the same way at a trust-domain switch under ``NNQUEUE_DOMAIN_SWITCH=restart``
(:meth:`EngineHealth.replace`): no report is read and every job the worker holds is requeued as it was.

The same replay names the culprit when the engine survived: a step of several traces in which one changed the
engine's state, or failed on a malformed intervention, fails each of them with ``StateModifiedInSharedStep``
(:mod:`nnqueue.enginecore.weights_guard`), and :meth:`EngineHealth.run_again_alone` requeues each marked
``run_alone``: the trace that does it again is then alone in its step, and fails for it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.lifecycle import InvalidTransition, JobNotFound, transition
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.db.session import transaction
from nnqueue.enginecore import untrusted_files
from nnqueue.scheduler import registry
from nnqueue.scheduler.enqueue import send_job_tokens

log = logging.getLogger(__name__)
# What the jobs a dead engine held are handed back with (and the restart it calls is told).
ENGINE_DIED = "its engine died"
T = TypeVar("T")

EXIT_ENGINE_DIED = 75  # EX_TEMPFAIL: try again (the supervisor restarts the worker)
MAX_ENGINE_CRASHES = 2
# How often a job that shared a step in which the engine's state changed runs again alone before it fails.
MAX_SHARED_STEP_RETRIES = 2
REPORT_WAIT_S = 5.0
MAX_REPORT_BYTES = 1 << 20  # a crash report is a claim of the engine's: read no more of it than this


def is_engine_death(error: BaseException) -> bool:
    """Whether ``error`` says the engine core is gone (vLLM's ``EngineDeadError``)."""
    return type(error).__name__ == "EngineDeadError"


def job_ids_in(request_ids: list[str]) -> set[uuid.UUID]:
    """The job ids in vLLM request ids (``<job id>-<attempt>-<invoke>[-<vLLM suffix>]``); others ignored."""
    jobs = set()
    for request_id in request_ids:
        try:
            jobs.add(uuid.UUID(str(request_id)[:36]))
        except ValueError:
            continue
    return jobs


# "stall": the worker killed the engine to stop intervention code past its deadline (nnqueue.workers.stall_deadline).
CAUSES = frozenset({"trace", "engine", "host", "stall"})
# The error a job alone in the fatal step fails with, by the report's cause.
ERROR_TYPES = {"host": "EngineHostError", "stall": "InterventionStalled"}


@dataclass(frozen=True)
class CrashReport:
    jobs: set[uuid.UUID]
    error: str
    cause: str = "engine"  # see nnqueue.enginecore.crash_report: "trace", "engine" or "host"; or "stall"
    where: str | None = None  # the trace's file:line, or the host error


def blame(report: CrashReport) -> str:
    """What a job alone in the fatal step is told: what failed, and whether its own code raised it."""
    if report.cause == "trace":
        return f"this job's trace crashed the engine (its code at {report.where} raised): {report.error}"
    if report.cause == "stall":
        return report.error.removeprefix("InterventionStalled: ")
    if report.cause == "host":
        return (
            "the engine crashed on a problem of this host's set-up, not in this job's code "
            f"({report.where}); the operator must fix it (see the worker's log): {report.error}"
        )
    return f"this job's trace crashed the engine, alone in the step that failed (vLLM's code raised): {report.error}"


def read_crash_report(directory: Path, wait_s: float = REPORT_WAIT_S) -> CrashReport | None:
    """The engine's crash report, waiting a little for it; None when the engine wrote none."""
    deadline = time.monotonic() + wait_s
    while True:
        for path in sorted(directory.glob("crash-*.json")):
            try:
                report = json.loads(untrusted_files.read(directory, path.name, MAX_REPORT_BYTES))
                request_ids = [str(each) for each in report.get("request_ids", [])][:10_000]
                cause = report.get("cause") if report.get("cause") in CAUSES else "engine"
                where = report.get("where")
                return CrashReport(
                    job_ids_in(request_ids),
                    str(report.get("error", ""))[:2000],
                    cause,
                    None if where is None else str(where)[:2000],
                )
            except (OSError, ValueError, AttributeError, TypeError):
                log.warning("unreadable crash report %s", path)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


class EngineGate:
    """Jobs marked ``run_alone`` run with no other job on the engine; the others share it."""

    def __init__(self) -> None:
        self._idle = asyncio.Condition()
        self._running = 0
        self._alone = False

    @asynccontextmanager
    async def _hold(self, alone: bool) -> Any:
        async with self._idle:
            await self._idle.wait_for(lambda: not self._alone and (not alone or self._running == 0))
            self._running += 1
            self._alone = alone
        try:
            yield
        finally:
            async with self._idle:
                self._running -= 1
                self._alone = False
                self._idle.notify_all()

    async def run(self, meta: dict[str, Any], coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` (a job's execution) when its turn comes."""
        async with self._hold(bool(isinstance(meta, dict) and meta.get("run_alone"))):
            return await coroutine


@dataclass
class EngineHealth:
    sessions: sessionmaker[Session]
    app: Celery
    worker_id: str
    model_key: str
    crash_dir: Path
    # Whether the engine has died (the AsyncLLM's ``errored``): a job may see the death second hand,
    # e.g. as a failed read of the engine's outbox, rather than as ``EngineDeadError``.
    engine_errored: Callable[[], bool] = field(default=lambda: False)
    # Called once the jobs are settled, to stop the process (default: a warm shutdown, SIGTERM).
    stop: Callable[[], None] = field(default=lambda: os.kill(os.getpid(), signal.SIGTERM))
    # Called once the jobs are settled, to start a fresh engine in this process; None, or when it raises: ``stop``.
    restart: Callable[[str], Awaitable[None]] | None = None  # called with why: what the jobs handed back say
    gate: EngineGate = field(default_factory=EngineGate)
    dead: threading.Event = field(default_factory=threading.Event)
    generation: int = 0  # the engine serving now: how many have been replaced before it
    _healed: asyncio.Future[None] | None = None

    def caused_by_death(self, error: BaseException) -> bool:
        """Whether ``error`` ended a job because the engine died."""
        return is_engine_death(error) or self.engine_errored()

    def hand_back(self) -> None:
        """A token this dead worker must not act on: send it again for another worker."""
        send_job_tokens(self.app, self.model_key)

    async def engine_died(self, generation: int | None = None) -> None:
        """Settle every job this worker holds and replace the engine, once (all its jobs' runs call this); see the
        module doc. ``generation``: the engine the caller ran on (None: the current one); an earlier one's death
        was healed already."""
        if generation is not None and generation != self.generation:
            return
        if self._healed is None:
            self.dead.set()
            # The worker's, not the calling job's: its records carry no job id (nnqueue.logs' job context).
            self._healed = asyncio.get_running_loop().create_task(self._recover(), context=contextvars.Context())
        await asyncio.shield(self._healed)

    async def replace(self, reason: str, keep: frozenset[uuid.UUID] = frozenset()) -> bool:
        """Start a fresh engine in place of the live one (a trust-domain switch, ``NNQUEUE_DOMAIN_SWITCH=restart``):
        the jobs this worker holds but ``keep`` go back to the queue as they were, none is blamed. False where the worker has no
        in-place restart (the transformers engine, a TRL trainer's) or the fresh engine failed to start (the worker
        then stops, as after a death)."""
        if self.restart is None:
            return False
        if self._healed is None:
            self.dead.set()
            recovery = self._recover(replaced=reason, keep=keep)
            self._healed = asyncio.get_running_loop().create_task(recovery, context=contextvars.Context())
        await asyncio.shield(self._healed)
        return not self.dead.is_set()

    async def restarted(self) -> bool:
        """Wait while a fresh engine starts; whether one serves (False: this worker stops, hand the work back)."""
        if self._healed is not None:
            await asyncio.shield(self._healed)
        return not self.dead.is_set()

    async def _recover(self, replaced: str | None = None, keep: frozenset[uuid.UUID] = frozenset()) -> None:
        await asyncio.to_thread(self._settle_jobs, replaced, keep)
        if self.restart is not None:
            try:
                await self.restart(f"its engine was replaced: {replaced}" if replaced else ENGINE_DIED)
            except Exception:  # the supervisor's fresh worker is the way out
                log.exception("a fresh engine could not be started in this worker; the worker restarts")
            else:
                self.generation += 1
                self._healed = None
                self.dead.clear()
                return
        await asyncio.to_thread(self._stop_worker)

    def _settle_jobs(self, replaced: str | None = None, keep: frozenset[uuid.UUID] = frozenset()) -> None:
        """Fail or requeue the jobs of a dead engine (see the module doc); ``replaced``: the live engine is being
        replaced for that reason, and every job but ``keep`` (a switch's new domain's, which run on the fresh engine)
        goes back to the queue as it was."""
        report = None if replaced else read_crash_report(self.crash_dir)
        if replaced:
            log.info("replacing the engine (%s); this worker's jobs go back to the queue", replaced)
        else:
            log.error(
                "the engine died (%s); settling this worker's jobs", report.error if report else "no crash report"
            )
        with self.sessions() as session:
            rows = session.execute(
                select(Job.id, Job.meta, Job.kind).where(
                    Job.status == JobStatus.RUNNING, Job.worker_id == self.worker_id
                )
            ).all()
        held = [(job_id, meta) for job_id, meta, _ in rows]
        traced = any(kind is JobKind.TRACE for _, _, kind in rows)
        if report is not None and traced and not report.jobs & {job_id for job_id, _ in held}:
            # The report is the engine's claim, and a trace ran there: one that names none of the jobs it ran is
            # taken as no report, or a trace could crash the engine at will and name another job (or none) to go
            # unblamed (a fifth red-team round).
            log.warning("the crash report names none of this worker's running jobs: read as no report")
            report = None
        in_step = {job_id for job_id, _ in held if not replaced and (report is None or job_id in report.jobs)}
        for job_id, meta in held:
            try:
                if replaced:
                    if job_id not in keep:
                        self._requeue(job_id, dict(meta or {}), f"its engine was replaced: {replaced}")
                    continue
                self._settle(job_id, dict(meta or {}), in_step, report)
            except (InvalidTransition, JobNotFound):
                continue  # cancelled or taken over meanwhile
            except Exception:  # one job's bookkeeping must not keep the others from being settled
                log.exception("could not settle job %s after the engine died", job_id)

    def _stop_worker(self) -> None:
        registry.mark_stopped(self.sessions, self.worker_id)
        self.stop()

    def _settle(
        self, job_id: uuid.UUID, meta: dict[str, Any], in_step: set[uuid.UUID], report: CrashReport | None
    ) -> None:
        error = report.error if report else "the engine process died without a report (killed?)"
        if job_id not in in_step:
            self._requeue(job_id, meta, "its engine died during another job's step")
            return
        crashes = int(meta.get("engine_crashes", 0)) + 1
        if len(in_step) == 1 and report is not None:
            why = blame(report)
        elif crashes >= MAX_ENGINE_CRASHES:
            why = f"this job was running each of the {crashes} times an engine crashed, the last time: {error}"
            if report is not None and report.cause == "host":
                why += f" (a problem of this host's set-up, not this job's code: {report.where})"
        else:
            self._requeue(
                job_id,
                {**meta, "engine_crashes": crashes, "run_alone": True},
                "it was in a step that crashed its engine",
            )
            return
        # A crash of the host's set-up is not held against the job's key (the crash cool-down counts EngineCrash).
        kind = ERROR_TYPES.get(report.cause, "EngineCrash") if report is not None else "EngineCrash"
        with transaction(self.sessions) as session:
            transition(
                session,
                job_id,
                JobStatus.FAILED,
                detail={"error": kind},
                held_by=self.worker_id,
                error_type=kind,
                error_message=why,
                error_traceback=report.error if report else "",
                meta={**meta, "engine_crashes": crashes},
            )
        log.error("job %s failed: %s", job_id, why)

    def run_again_alone(self, job_id: uuid.UUID, meta: dict[str, Any], reason: str) -> bool:
        """Requeue a job that shared a step in which a trace changed the engine's state (the engine put it back;
        ``StateModifiedInSharedStep``), marked ``run_alone``: run alone, only the trace that changes the state
        again is failed for it. False (the job then fails with that error) once it has run again alone
        :data:`MAX_SHARED_STEP_RETRIES` times."""
        retries = int(meta.get("shared_step_retries", 0)) + 1
        if retries > MAX_SHARED_STEP_RETRIES:
            return False
        try:
            self._requeue(job_id, {**meta, "run_alone": True, "shared_step_retries": retries}, reason)
        except (InvalidTransition, JobNotFound):
            return True  # cancelled or taken over meanwhile: its status is the other writer's
        return True

    def _requeue(self, job_id: uuid.UUID, meta: dict[str, Any], reason: str) -> None:
        with transaction(self.sessions) as session:
            job = transition(
                session,
                job_id,
                JobStatus.QUEUED,
                detail={"reason": f"worker {self.worker_id}: {reason}"},
                held_by=self.worker_id,
                meta=meta,
            )
        send_job_tokens(self.app, job.model_key)
        log.info("job %s requeued (%s)", job_id, reason)
