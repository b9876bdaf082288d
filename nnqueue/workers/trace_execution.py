"""The vLLM trace executor: a claimed trace job's payload, run on the worker's engine, its result committed.

The payload is parsed without unpickling (:mod:`nnqueue.trace_payload`, :mod:`nnqueue.engines.prebuilt`);
a raw nnsight payload is first prebuilt by a sandboxed builder process (:mod:`nnqueue.engines.builders`), and a
prebuilt one's mediators are loaded there once as a check, so one the engine could not load fails its job here.
A session (several traces passing values, ``model.session()``) runs its body in a builder, which sends each of
its traces back to run here (:mod:`nnqueue.engines.sessions`). The engine runs the requests and writes the result
to the sinks this worker hands it
(:mod:`nnqueue.engines.trace_runner`); this process commits it without ever unpickling a save, and the job
fails with the trace's first error, as the transformers executor's do (:mod:`nnqueue.workers.trace_jobs`).
A payload that cannot be rebuilt fails naming both sides' versions when they differ; a request vLLM refuses (``VLLMValidationError``: a prompt over ``max_model_len``) fails with
vLLM's type and message, which the client raises as that type (:mod:`nnqueue.client.errors`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from nnqueue import trace_payload
from nnqueue.db.models import Job, JobKind
from nnqueue.enginecore.child_process import ChildError
from nnqueue.engines import prebuilt, sessions, trace_runner
from nnqueue.engines.builders import BuilderPool
from nnqueue.engines.outbox import OutboxPoller, poller
from nnqueue.engines.trace_report import TraceReport, parse_report
from nnqueue.scheduler.trust_domains import job_domain_of
from nnqueue.storage.object_store import ObjectStore
from nnqueue.timeline import stamp
from nnqueue.workers.engine_processes import kill_and_wait
from nnqueue.workers.job_execution import Execution, JobFailure
from nnqueue.workers.sinks import ResultNotWritten, ResultSinks, ResultTooLarge
from nnqueue.workers.steer_execution import execute_steering
from nnqueue.workers.trace_jobs import PayloadReads, rebuild_message, run_and_commit

log = logging.getLogger(__name__)

try:  # vLLM's checks of a request raise these (0.32); older vLLM (0.24 on the GPU) raises ValueError
    from vllm.exceptions import VLLMClientError as RequestRefused
except ImportError:
    RequestRefused = ValueError  # type: ignore[assignment,misc]


@dataclass
class VLLMTraceExecutor:
    sessions: sessionmaker[Session]  # small payloads are kept in the database (nnqueue.scheduler.payloads)
    store: ObjectStore
    model: Any  # a dispatched async nnsight VLLM
    sinks: ResultSinks
    outbox: OutboxPoller
    builders: BuilderPool
    payloads: PayloadReads = field(init=False)

    def __post_init__(self) -> None:
        self.payloads = PayloadReads(self.sessions, self.store)

    async def execute(self, job: Job, progress: Callable[[int, int], None]) -> Execution:
        if job.kind is JobKind.STEER:  # declarative, on the engine's steering path: no trace to build
            return await execute_steering(self, job, progress)
        payload = await self.payloads.load(job)
        stamp("payload")
        if sessions.is_session(payload):
            return await self._execute_session(job, payload, progress)
        trace, requests = await self._prepare(job, payload)
        stamp("built")
        total = len(requests.request_ids)
        progress(0, total)

        async def run(sinks: dict[str, Any]) -> TraceReport:
            try:
                return await trace_runner.run_trace(
                    self.model,
                    requests,
                    trace_id=f"{job.id}-{job.attempts}",
                    sinks=sinks,
                    outbox=self.outbox,
                    on_finished=lambda done: progress(done, total),
                )
            except RequestRefused as refused:  # vLLM's checks of a request (a prompt over max_model_len)
                raise JobFailure(type(refused).__name__, str(refused)) from None

        return await run_and_commit(self.sinks, job, total, run, trace)

    async def _execute_session(self, job: Job, payload: bytes, progress: Callable[[int, int], None]) -> Execution:
        """A session (:mod:`nnqueue.engines.sessions`): its body in a builder, each of its traces run here when the
        builder asks (`_run_session_trace`), its result written by the builder and committed as a trace's. Progress
        counts the traces run (the total is not known before the body ends)."""
        ran = [0]

        async def run_trace(prebuilt_trace: bytes) -> bytes:
            ran[0] += 1
            progress(ran[0] - 1, ran[0])
            answer = await self._run_session_trace(job, ran[0], prebuilt_trace)
            progress(ran[0], ran[0] + 1)
            return answer

        async def run(sinks: dict[str, Any]) -> TraceReport:
            try:
                report = await self.builders.run_session(payload, job_domain_of(job), sinks, run_trace)
            except ChildError as failed:  # the body's error, a trace's (naming it), or its payload's
                # A trace's failure, as a trace job's is: one that shared a step with a state change runs again alone.
                reported = {"type_name": failed.type_name, "message": failed.message, "traceback": failed.traceback}
                return TraceReport({**reported, "is_control_flow": False}, False, {}, None)
            try:
                return parse_report(json.loads(report))
            except (ValueError, RecursionError) as error:
                raise JobFailure(
                    "InvalidPayload", f"the session's builder answered with a malformed report: {error}"
                ) from None

        progress(0, 1)
        execution = await run_and_commit(self.sinks, job, 0, run)
        return dataclasses.replace(execution, units=ran[0])

    async def _run_session_trace(self, job: Job, index: int, payload: bytes) -> bytes:
        """Run trace ``index`` of a session job (a prebuilt payload from its builder, untrusted and checked as a
        client's is, in another builder) on the engine; the reply for the builder: its saves or its error. Raises
        only what would fail any trace's job (the engine died, the job was cancelled)."""
        try:
            _, requests = await self._parse(job, payload, f"{job.id}-{job.attempts}-{index}", check=True)
        except JobFailure as failed:
            return sessions.reply(b"", {"type_name": failed.type_name, "message": failed.message})
        async with self.sinks.staged_result(job.id, job.attempts, safetensors=False, part=f"trace{index}") as handoff:
            try:
                report = await trace_runner.run_trace(
                    self.model,
                    requests,
                    trace_id=f"{job.id}-{job.attempts}-{index}",
                    sinks=handoff.specs,
                    outbox=self.outbox,
                )
            except (RequestRefused, ValueError) as refused:  # vLLM's checks of a request, a malformed engine report
                return sessions.reply(b"", {"type_name": type(refused).__name__, "message": str(refused)})
            if report.write_error is not None and report.error is None:
                return sessions.reply(b"", {"type_name": "ResultWriteFailed", "message": report.write_error})
            try:
                saves = (
                    await asyncio.to_thread(self.sinks.read_back, handoff, report.objects) if report.objects else b""
                )
            except (ResultTooLarge, ResultNotWritten, OSError) as error:
                return sessions.reply(b"", {"type_name": type(error).__name__, "message": str(error)})
        return sessions.reply(saves, report.error)

    async def close(self) -> None:
        """Stop the builders and the engine (at once: the worker drained its jobs; its processes' end awaited)."""
        await self.builders.close()
        # vLLM's output handler, left waiting, would log the killed core as a failure (AsyncLLM.output_handler, a task
        # on this loop, vLLM 0.24-0.32): nothing is waiting for outputs now.
        if (handler := getattr(self.model.vllm_entrypoint, "output_handler", None)) is not None:
            handler.cancel()
            await asyncio.sleep(0)
        await asyncio.to_thread(kill_and_wait, self.model.vllm_entrypoint)

    def use_engine(self, model: Any) -> None:
        """Run jobs on ``model`` (a dispatched VLLM that replaced a dead one: :mod:`nnqueue.workers.engine_restart`)
        from now on; the trace builders stay."""
        self.model, self.outbox = model, poller(model.vllm_entrypoint)

    async def leave_domain(self) -> None:
        """The trace builders that ran the old domain's code are replaced (:meth:`BuilderPool.retire_domains`), before
        anything else of the switch: a fifth red-team round left a thread in one that wrote into the crash folder after
        the restart switch had emptied it, and had the worker kill the next domain's fresh engine."""
        retired = await self.builders.retire_domains()
        if retired:
            log.info("%d trace builder(s) that ran a trust domain's code replaced at the switch", retired)

    async def verify_engine_state(self) -> list[str]:
        """Before the engine serves another trust domain (:mod:`nnqueue.scheduler.domain_turns`): every rank's
        guards read every weight and buffer in full and verify the rest of the engine's state (module attributes,
        hooks, classes, the engine's own code), put back what changed and say what they put back
        (``nnqueue_verify_state``: :mod:`nnqueue.enginecore.weights_guard`). Runs between engine steps (vLLM serves
        RPCs there), and seed torch's generators afresh, so that the old domain cannot know how the new one's
        sampling without a seed of its own draws. With ``NNQUEUE_WEIGHTS_GUARD=false`` there are no guards: nothing
        is checked. Raises when a rank could not restore its state."""
        seed = secrets.randbits(63)  # one for every rank: tensor-parallel ranks must sample alike
        answers = await self.model.vllm_entrypoint.collective_rpc("nnqueue_verify_state", args=(seed,))
        for rank, answer in enumerate(answers):
            for zeroed in (answer or {}).get("zeroed", ()):
                # The worker's record of what the engine answered (under restart, a fresh engine that ran nothing
                # yet): an engine's own log lines are relayed, and an escaped one can write lines in their shape.
                log.info("trust-domain switch: rank %d zeroed %s KV cache blocks", rank, zeroed)
        kinds = ("weights", "state", "lazy")
        return sorted({name for answer in answers for kind in kinds for name in (answer or {}).get(kind, ())})

    async def _prepare(self, job: Job, payload: bytes) -> tuple[trace_payload.PrebuiltTrace, prebuilt.TraceRequests]:
        """The payload's trace and its vLLM requests: parsed, after a builder process prebuilt a raw payload."""
        kind = trace_payload.payload_kind(payload)
        if kind is None:
            raise JobFailure(
                "InvalidPayload",
                rebuild_message(
                    "the payload is neither an nnqueue prebuilt trace nor an nnsight serialized trace", job
                ),
            )
        if kind == "nnsight":
            try:
                payload = await self.builders.build(payload, job_domain_of(job))  # its mediators checked too
            except ChildError as failed:
                raise JobFailure(failed.type_name, rebuild_message(failed.message, job), failed.traceback) from None
        return await self._parse(job, payload, f"{job.id}-{job.attempts}", check=kind == "prebuilt")

    async def _parse(
        self, job: Job, payload: bytes, request_prefix: str, check: bool
    ) -> tuple[trace_payload.PrebuiltTrace, prebuilt.TraceRequests]:
        """A prebuilt payload's trace and its vLLM requests (ids under ``request_prefix``); with ``check``, its
        mediators checked strictly in a builder first (a client's or a session body's prebuilt trace: untrusted)."""
        trace = None
        try:
            trace = trace_payload.decode(payload)
            requests = prebuilt.to_requests(trace, request_prefix)
        except trace_payload.PayloadError as error:
            raise JobFailure(
                "InvalidPayload", rebuild_message(str(error), job, trace), traceback.format_exc()
            ) from None
        if check:
            try:
                await self.builders.check(payload, job_domain_of(job))
            except ChildError as failed:
                raise JobFailure(
                    failed.type_name, rebuild_message(failed.message, job, trace), failed.traceback
                ) from None
        return trace, requests
