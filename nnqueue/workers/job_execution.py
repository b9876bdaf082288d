"""Running one job on the worker: claim it, hand it to the engine's executor, record how it ended.

A delivered token names no job: the runner claims the best QUEUED job of its model (:func:`claim_jobs`:
highest priority, then oldest), and a token that finds none is dropped. Claims are compare-and-set, so a job
runs under one worker at a time. A worker whose engine is not isolated fails another owner's trace at once, saying
why (:meth:`nnqueue.isolation.Containment.refusal`). Every outcome is a status change with its cause: COMPLETED with the result's key,
or FAILED with the error's type, message and the user's traceback (and the result, when the trace saved
values before it failed). A cancel is seen by :meth:`JobRunner.reap_lost`, which the heartbeat calls; it
cancels the job's task, which aborts its engine requests, as it does for a job requeued while this worker
looked dead. A worker finishes only a job it still holds (the finishing update is guarded by the holder).

Traces run on an engine one trust domain at a time (:mod:`nnqueue.scheduler.domain_turns`): the claim takes traces
of the runner's current domain only, and a switch to another domain waits until none of the old one's are in
flight, then puts back and verifies the engine's state (:meth:`JobRunner._switch_domain`; under
``NNQUEUE_DOMAIN_SWITCH=restart`` on a fresh engine process) before the new domain's first trace starts; under
``restart`` the turns cover steering jobs and the chunk runner's harvest chunks too (``DomainTurns.all_work``:
:meth:`JobRunner.enter_turn`, :meth:`JobRunner.unit_ended`). A token that finds no job while other domains' work
waits for this worker's turn to end waits for it, rather than being dropped.

Running is the executor's (:class:`Executor`): one per engine kind, the vLLM trace executor
(:mod:`nnqueue.workers.trace_execution`) and the transformers one (:mod:`nnqueue.workers.transformers_execution`). Database calls run in threads (``asyncio.to_thread``) so that
the engine loop keeps serving the other jobs, and go together: the claims of the tokens that arrive while a
claim is in flight are one transaction, and so are the ends of jobs that end meanwhile
(:mod:`nnqueue.workers.grouped_calls`); progress is written as the executor reports it, throttled, in the
background, every running job's in one statement (:class:`ProgressBook`), so it never delays a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.db.lifecycle import Ending, InvalidTransition, finish_held, transition
from nnqueue.db.models import Job, JobKind, JobStatus
from nnqueue.db.session import transaction
from nnqueue.enginecore.weights_guard import SHARED_STEP_ERROR
from nnqueue.errors import NNqueueError
from nnqueue.isolation import Containment
from nnqueue.logs import job_context
from nnqueue.scheduler import registry
from nnqueue.scheduler.claim import claim_jobs
from nnqueue.scheduler.domain_turns import DomainTurns, Switch
from nnqueue.storage.results import StoredResult
from nnqueue.timeline import Timelines, stamp
from nnqueue.workers.engine_health import EngineHealth
from nnqueue.workers.grouped_calls import GroupedCalls
from nnqueue.workers.weights import WeightsGate, WrongWeights

log = logging.getLogger(__name__)
S = JobStatus
# Progress is written at most this often per job; a job shorter than the first delay writes none
# until it finishes (COMPLETED records the final count).
PROGRESS_FIRST_S = 0.5
PROGRESS_EVERY_S = 1.0


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # taken over by another worker while it ran
    NO_WORK = "no_work"  # the token found no queued work
    HANDED_OFF = "handed_off"  # a harvest chunk's shard is written; its upload goes on without the engine


@dataclass
class JobFailure(NNqueueError):
    type_name: str
    message: str
    traceback: str = ""


class EngineStateUnverified(NNqueueError):
    """The engine's state could not be put back and verified at a domain switch: it must not run another domain's
    traces (the worker restarts; the traces go back to the queue)."""


@dataclass
class Execution:
    """How an executor's run of a job ended: its size in units of progress, its stored result (if any),
    and its failure (if any: a job can fail and still have a result, the saves made before the error)."""

    units: int
    result: StoredResult | None = None
    failure: JobFailure | None = None


class Executor(Protocol):
    async def execute(self, job: Job, progress: Callable[[int, int], None]) -> Execution:
        """Run the claimed ``job``; call ``progress(done, total)`` as units finish. Raises :class:`JobFailure`
        when the job cannot run at all."""
        ...

    async def close(self) -> None:
        """Release the engine (the worker is stopping)."""
        ...

    async def leave_domain(self) -> None:
        """Stop what ran the old trust domain's code beside the engine (the trace builders), first thing at a switch:
        before the engine is replaced and its crash folder emptied, which their leftovers could write again."""
        ...

    async def verify_engine_state(self) -> list[str]:
        """Put back what traces changed of the engine's state and verify it, before the engine serves another trust
        domain; the names of what was put back. Raises if it cannot be (the engine must not be used)."""
        ...


@dataclass
class JobRunner:
    sessions: sessionmaker[Session]
    executor: Executor
    model_key: str
    worker_id: str
    # Settles the worker's jobs if the engine dies (and runs `run_alone` jobs alone); None in tests.
    health: EngineHealth | None = None
    # The engine's weights version and update gate (nnqueue.workers.weights); None: versions are not tracked.
    weights: WeightsGate | None = None
    # What the engine runs under (nnqueue.isolation): a degraded one runs no other owner's trace. None: any trace.
    containment: Containment | None = None
    # Which trust domain's traces the engine runs now, and when that may change.
    turns: DomainTurns = field(default_factory=DomainTurns)
    # A trust-domain switch starts a fresh engine process before it verifies (NNQUEUE_DOMAIN_SWITCH=restart).
    fresh_engine_at_switch: bool = False
    # Where each run's timeline is kept (nnqueue.timeline; the benchmarks'); None: no timelines.
    timelines: Timelines | None = None
    _running: dict[uuid.UUID, asyncio.Task[Any]] = field(default_factory=dict)
    _versions: dict[uuid.UUID, str] = field(default_factory=dict)  # the weights each running job runs on
    # Running jobs this worker stopped, and why: CANCELLED by a user, or SKIPPED (taken by another worker).
    _aborted: dict[uuid.UUID, Outcome] = field(default_factory=dict)
    _progress: ProgressBook = field(init=False)
    _claims: GroupedCalls[None, Job | None] = field(init=False)
    _endings: GroupedCalls[Ending, Job] = field(init=False)
    _turn_over: asyncio.Event = field(default_factory=asyncio.Event)  # set when the turn's last trace ended
    _switching: tuple[Switch, asyncio.Future[None]] | None = None  # the switch being verified
    _entering: set[uuid.UUID] = field(default_factory=set)  # traces waiting for a switch to their domain
    # The new domain's traces that waited for a switch which replaced the engine: they run on the fresh one.
    _kept: set[uuid.UUID] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._progress = ProgressBook(self.sessions, self.worker_id)
        self._claims = GroupedCalls(self._claim)
        self._endings = GroupedCalls(self._end)

    async def run_next(self) -> Outcome:
        """Claim the model's best QUEUED job and run it (what a token asks for)."""
        with self.timelines.run() if self.timelines is not None else contextlib.nullcontext():
            stamp("token")
            return await self._claim_and_run()

    async def _claim_and_run(self) -> Outcome:
        while True:
            if self.health is not None and self.health.dead.is_set() and not await self.health.restarted():
                await asyncio.to_thread(self.health.hand_back)  # the engine is gone: another worker takes the work
                return Outcome.SKIPPED
            turn_over = self.turn_end()
            job = await self._claims(None)
            if job is not None or not self.turns.others_wait():
                break
            # Traces that this engine runs only after its domain's turn wait: keep the token until the turn ends
            # (a dropped one would leave them waiting for the reconciler).
            await self.wait_for_turn(turn_over)
        if job is None:
            log.info("a token for %s found no queued job; dropped", self.model_key)
            return Outcome.NO_WORK
        stamp("claimed")
        with job_context(job.id):
            return await self._run(job)

    async def _run(self, job: Job) -> Outcome:
        job_id = job.id
        waited = _seconds(job.queued_at, job.started_at)
        metrics.QUEUE_WAIT.labels(job.model_key, job.kind.value).observe(waited)
        log.info("job %s started (attempt %d) after %.3f s in the queue", job_id, job.attempts, waited)
        refusal = self.containment.refusal(job.owner) if self.containment and job.kind is JobKind.TRACE else None
        task = asyncio.current_task()
        assert task is not None
        self._running[job_id] = task
        generation = self.health.generation if self.health is not None else 0  # the engine it runs on
        try:
            if refusal is not None:  # in here: the finally ends the domain turn its claim began
                return await self._fail(job_id, JobFailure("EngineNotIsolated", refusal))
            await self._enter_domain(job)
            if job_id in self._kept:  # it waited for the switch that replaced the engine: it runs on the fresh one
                self._kept.discard(job_id)
            elif self.health is not None and self.health.generation != generation:
                # The engine it was claimed for was replaced meanwhile (a switch's fresh engine, a dead one's): back to
                # the queue, unless the replacement put it there.
                with contextlib.suppress(InvalidTransition):
                    await asyncio.to_thread(self._hand_back, job_id, "its engine was replaced before it started")
                return Outcome.SKIPPED
            running = self._on_weights(
                job, self.executor.execute(job, functools.partial(self._progress.report, job_id))
            )
            if self.health is not None:  # a job that was in a step that crashed an engine runs alone
                running = self.health.gate.run(job.meta, running)
            execution = await asyncio.wait_for(running, timeout=job.timeout_s)
            result = execution.result
            fields: dict[str, Any] = {"progress_done": execution.units, "progress_total": execution.units}
            if result is not None:
                fields.update(
                    result_key=result.key,
                    result_size=result.size,
                    result_format=result.format,
                    result_sha256=result.sha256,
                    result_safetensors_size=result.safetensors.size if result.safetensors else None,
                    result_safetensors_sha256=result.safetensors.sha256 if result.safetensors else None,
                )
                metrics.STORE_BYTES_WRITTEN.labels("result").inc(result.size)
            if execution.failure is not None:
                if await self._run_again_alone(job, execution.failure):
                    return Outcome.SKIPPED
                return await self._fail(job_id, execution.failure, **fields)
            detail = {"result_bytes": result.size if result else 0}
            return await self._finish(job_id, S.COMPLETED, detail, **fields)
        except asyncio.CancelledError:
            if job_id not in self._aborted:
                raise  # the worker is shutting down; the message is redelivered
            outcome = self._aborted[job_id]
            why = "cancelled" if outcome is Outcome.CANCELLED else "taken over by another worker"
            log.info("job %s %s; its requests were aborted", job_id, why)
            return outcome  # its status is the canceller's or the new holder's
        except WrongWeights as wrong:
            await asyncio.to_thread(self._hand_back, job_id, str(wrong))
            return Outcome.SKIPPED
        except EngineStateUnverified as unverified:
            log.error("%s; the worker restarts", unverified)
            with contextlib.suppress(InvalidTransition):  # a replacement that failed has requeued it already
                await asyncio.to_thread(self._hand_back, job_id, str(unverified))
            self.restart_unverified()
            return Outcome.SKIPPED
        except TimeoutError:
            failure = JobFailure("JobTimeout", f"job exceeded its timeout of {job.timeout_s:g} s and was aborted")
            return await self._fail(job_id, failure)
        except JobFailure as failure:
            return await self._fail(job_id, failure)
        except Exception as error:  # our side failed (object store, engine): say so, don't hang
            if self.health is not None and self.health.caused_by_death(error):
                # Fails or requeues this job with the others; a cancel meanwhile (the worker reaps the jobs it no
                # longer holds before it starts a fresh engine) changes nothing of that.
                with contextlib.suppress(asyncio.CancelledError):
                    await self.health.engine_died(generation)
                return Outcome.SKIPPED
            log.exception("job %s failed in the worker", job_id)
            return await self._fail(job_id, JobFailure(type(error).__name__, str(error), traceback.format_exc()))
        finally:
            self._progress.forget(job_id)
            self._versions.pop(job_id, None)
            self._running.pop(job_id, None)
            self._aborted.pop(job_id, None)
            self.unit_ended(job_id)

    def unit_ended(self, unit: Hashable) -> None:
        """A job or chunk (:func:`~nnqueue.scheduler.claim.chunk_key`) the domain turns counted ended here: when it
        was the last one in flight, tokens waiting for the turn (or the drain before one) go on."""
        if self.turns.ended(unit):
            self._turn_over.set()
            self._turn_over = asyncio.Event()

    def restart_unverified(self) -> None:
        """A switch could not put back and verify the engine (:class:`EngineStateUnverified`): as if it died, the worker
        stops for a fresh one (its supervisor starts it), rather than serve, or fail every unit of the domain on it."""
        if self.health is not None and not self.health.dead.is_set():
            self.health.dead.set()
            self.health.stop()

    def turn_end(self) -> asyncio.Event:
        """Set when the current turn ends: taken before a claim, it is set even when the turn ends during the claim."""
        return self._turn_over

    async def wait_for_turn(self, turn_end: asyncio.Event) -> None:
        """Until ``turn_end`` is set, or one hold has passed (the caller claims again: checked at least that often)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(turn_end.wait(), timeout=max(self.turns.hold_s, 1.0))

    async def _enter_domain(self, job: Job) -> None:
        """Let a trace (with ``turns.all_work``, any job) start only once the switch to its domain, if one is under
        way, has verified the engine."""
        if job.kind is not JobKind.TRACE and not self.turns.all_work:
            return
        self._entering.add(job.id)
        try:
            await self.enter_turn()
        finally:
            self._entering.discard(job.id)

    async def enter_turn(self) -> None:
        """Return once the switch under way, if any, has verified the engine (or raise
        :class:`EngineStateUnverified`): what was claimed after it runs on the engine it leaves."""
        switch = self.turns.unverified()
        if switch is None:
            return
        if self._switching is None or self._switching[0] is not switch:
            self._switching = (switch, asyncio.ensure_future(self._switch_domain(switch)))
        await asyncio.shield(self._switching[1])

    async def _switch_domain(self, switch: Switch) -> None:
        """The engine moves to ``switch.domain``: nothing of the previous domain is in flight; its state is put back
        and verified (`Executor.verify_engine_state`) before any trace of the new domain starts. With
        ``fresh_engine_at_switch`` a fresh engine process replaces it first (:meth:`EngineHealth.replace`): nothing
        the old domain's code did inside the engine's process, seen by the guards or not, reaches the new domain; the
        jobs this worker held go back to the queue and are claimed again, but the new domain's traces waiting for the
        switch, which run on the fresh engine."""
        started = time.monotonic()
        if switch.previous is not None:
            try:
                await self.executor.leave_domain()
            except Exception as error:  # the old domain's builders may live on: the engine must not serve the new one
                raise EngineStateUnverified(
                    f"what ran trust domain {switch.previous!r}'s code could not be stopped: {error!r}"
                ) from error
            if self.fresh_engine_at_switch and self.health is not None:
                why = f"a switch from trust domain {switch.previous!r} to {switch.domain!r}"
                # The new domain's traces waiting for this switch stay claimed and run on the fresh engine: handed
                # back with the rest, the next claim could take the old domain's again and switch back (a fifth
                # red-team round saw two owners' jobs replace the engine 31 times in 4 minutes, neither ever run).
                self._kept = set(self._entering)
                if not await self.health.replace(why, keep=frozenset(self._kept)):
                    self._kept.clear()
                    raise EngineStateUnverified(f"no fresh engine could be started for {why}")
            try:
                restored = await self.executor.verify_engine_state()
            except Exception as error:
                self._kept.clear()  # they are handed back: the switch failed
                raise EngineStateUnverified(
                    f"the engine's state could not be verified when switching from trust domain {switch.previous!r} "
                    f"to {switch.domain!r}: {type(error).__name__}: {error}"
                ) from error
            if restored:
                log.error(
                    "switching from trust domain %r to %r: %d changes to the engine's state were found and put back"
                    " (%s); traces of %r made them",
                    switch.previous,
                    switch.domain,
                    len(restored),
                    ", ".join(restored[:10]),
                    switch.previous,
                )
            metrics.DOMAIN_SWITCHES.labels(self.model_key).inc()
            metrics.DOMAIN_SWITCH_TIME.labels(self.model_key).observe(time.monotonic() - started)
        self.turns.verified(switch)
        verified_s = time.monotonic() - started
        log.info(
            "the engine serves trust domain %r (was %r; verified in %.3f s)", switch.domain, switch.previous, verified_s
        )
        try:
            await asyncio.to_thread(registry.set_domain, self.sessions, self.worker_id, switch.domain)
        except Exception:  # what the listings show: the next switch writes it again
            log.warning("recording the worker's trust domain failed", exc_info=True)

    async def _on_weights(self, job: Job, execution: Coroutine[Any, Any, Execution]) -> Execution:
        """Run ``execution`` holding the weights still (no update in between), noting the version it runs on."""
        if self.weights is None:
            return await execution
        try:
            async with self.weights.serving(job.weights_pin) as version:
                self._versions[job.id] = version
                return await execution
        finally:
            execution.close()  # never started when the gate refused it: no "never awaited" warning

    async def _run_again_alone(self, job: Job, failure: JobFailure) -> bool:
        """A job that shared a step in which another trace may have changed the engine's state is requeued to run
        alone (:meth:`EngineHealth.run_again_alone`); whether it was."""
        if self.health is None or failure.type_name != SHARED_STEP_ERROR:
            return False
        meta = dict(job.meta or {})
        ran_again = await asyncio.to_thread(self.health.run_again_alone, job.id, meta, failure.message[:500])
        if ran_again:
            log.info("job %s runs again alone: %s", job.id, failure.message)
        return ran_again

    def _hand_back(self, job_id: uuid.UUID, reason: str) -> None:
        """A job this engine must not run (a pinned job that reached it after it moved to another version, a trace
        claimed for an engine that a switch replaced): back to the queue."""
        with transaction(self.sessions) as session:
            transition(session, job_id, S.QUEUED, detail={"reason": reason}, held_by=self.worker_id)
        if self.health is not None:  # a token for a worker serving its pin (the reconciler's otherwise)
            self.health.hand_back()
        log.info("job %s handed back to the queue: %s", job_id, reason)

    async def _finish(self, job_id: uuid.UUID, target: JobStatus, detail: dict[str, Any], **fields: Any) -> Outcome:
        if job_id in self._versions:
            fields["weights_version"] = self._versions[job_id]
        try:
            job = await self._endings(Ending(job_id, target, detail, fields))
            stamp("finished")
        except InvalidTransition as lost:
            # Cancelled or taken over while finishing: the other writer's status stands.
            log.info("job %s not marked %s: %s", job_id, target.value, lost)
            return Outcome.CANCELLED if lost.current is S.CANCELLED else Outcome.SKIPPED
        labels, ran = (job.model_key, job.kind.value, target.value), _seconds(job.started_at, job.finished_at)
        metrics.JOBS_FINISHED.labels(*labels).inc()
        metrics.RUN_TIME.labels(*labels).observe(ran)
        log.info("job %s %s after %.3f s", job_id, target.value, ran)
        return Outcome(target.value)

    async def _fail(self, job_id: uuid.UUID, failure: JobFailure, **fields: Any) -> Outcome:
        return await self._finish(
            job_id,
            S.FAILED,
            {"error": failure.type_name},
            error_type=failure.type_name,
            error_message=failure.message,
            error_traceback=failure.traceback,
            **fields,
        )

    def _claim(self, tokens: list[None]) -> list[Job | None]:
        """A job for each of the tokens that arrived together, in one transaction (None: no more queued)."""
        version = self.weights.version if self.weights is not None else None
        claimed = claim_jobs(self.sessions, self.model_key, self.worker_id, len(tokens), version, self.turns)
        jobs: list[Job | None] = list(claimed)
        return jobs + [None] * (len(tokens) - len(jobs))

    def _end(self, endings: list[Ending]) -> list[Job | Exception]:
        """The jobs that ended together, recorded in one transaction; if that fails, each in its own, so that one
        job's bad row (a NUL in an error message, say) cannot fail the others' ends."""
        try:
            with transaction(self.sessions) as session:
                return list(finish_held(session, endings, self.worker_id))
        except Exception:
            if len(endings) == 1:
                raise
            log.warning("recording %d job ends together failed; recording each alone", len(endings), exc_info=True)
        return [self._end_alone(ending) for ending in endings]

    def _end_alone(self, ending: Ending) -> Job | Exception:
        try:
            with transaction(self.sessions) as session:
                return finish_held(session, [ending], self.worker_id)[0]
        except Exception as error:  # noqa: BLE001 - this job's own failure, raised to its caller
            return error

    def running_jobs(self) -> list[uuid.UUID]:
        return list(self._running)

    def jobs_on_engine(self) -> list[uuid.UUID]:
        """The running jobs but those a switch keeps for the fresh engine it starts (what a restart hands back)."""
        return [job_id for job_id in self._running if job_id not in self._kept]

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


class ProgressBook:
    """Writes the progress of a worker's running jobs in the background, every job with news in one statement.

    A job's first report is written after ``first_s``, then its latest at most every ``every_s``; one write
    in flight at a time, never after the job left RUNNING under this worker. All done is not written: the
    job's end writes it in the same moment. Nothing done yet is: "0/N invokes" tells a waiting user the job's
    size. One statement for all jobs, not a transaction per job: with 256 one-prompt jobs in flight, a write
    per job was 256 transactions a run, each Python under the GIL that the engine loop shares."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        worker_id: str,
        first_s: float = PROGRESS_FIRST_S,
        every_s: float = PROGRESS_EVERY_S,
    ) -> None:
        self.sessions, self.worker_id = sessions, worker_id
        self.first_s, self.every_s = first_s, every_s
        self._jobs: dict[uuid.UUID, _Progress] = {}
        self._task: asyncio.Task[None] | None = None

    def report(self, job_id: uuid.UUID, done: int, total: int) -> None:
        """Record ``job_id``'s progress (call on the engine loop)."""
        if done >= total:
            return
        progress = self._jobs.get(job_id)
        if progress is None:
            self._jobs[job_id] = _Progress(due=asyncio.get_running_loop().time() + self.first_s, latest=(done, total))
        else:
            progress.latest = (done, total)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._write_while_running())

    def forget(self, job_id: uuid.UUID) -> None:
        """The job ended: write nothing more for it."""
        self._jobs.pop(job_id, None)

    async def _write_while_running(self) -> None:
        loop = asyncio.get_running_loop()
        while self._jobs:
            await asyncio.sleep(min(self.first_s, self.every_s) / 4)
            now = loop.time()
            due = {
                job_id: progress.latest
                for job_id, progress in self._jobs.items()
                if progress.due <= now and progress.latest != progress.written
            }
            if not due:
                continue
            try:
                await asyncio.to_thread(self._write, due)
                written = True
            except Exception:  # the database is away: progress is a courtesy, try again a period later
                log.warning("writing the progress of %d jobs failed", len(due), exc_info=True)
                written = False
            for job_id, latest in due.items():
                if (progress := self._jobs.get(job_id)) is not None:
                    progress.due = now + self.every_s
                    if written:
                        progress.written = latest

    def _write(self, due: dict[uuid.UUID, tuple[int, int]]) -> None:
        # In id order: the rows are locked in the order of the jobs' ends (lifecycle.finish_held), so that the two
        # never deadlock.
        rows = [
            {"id": job_id, "progress_done": done, "progress_total": total}
            for job_id, (done, total) in sorted(due.items())
        ]
        with transaction(self.sessions) as session:
            # An UPDATE by primary key per row, sent together; the extra criteria keep a job that left RUNNING
            # under this worker (finished, cancelled, taken over) as it is.
            session.execute(
                update(Job).where(Job.status == S.RUNNING, Job.worker_id == self.worker_id),
                rows,
                execution_options={"synchronize_session": None},
            )


@dataclass
class _Progress:
    due: float  # loop time from which the next write may be made
    latest: tuple[int, int]
    written: tuple[int, int] | None = None


def _seconds(start: datetime | None, end: datetime | None) -> float:
    """Seconds from ``start`` to ``end`` (0 when either is unknown)."""
    return 0.0 if start is None or end is None else max(0.0, (end - start).total_seconds())
