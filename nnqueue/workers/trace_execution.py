"""The vLLM trace executor: a claimed trace job's payload, run on the worker's engine, its result committed.

The payload is parsed without unpickling (:mod:`nnqueue.trace_payload`, :mod:`nnqueue.engines.prebuilt`);
a raw nnsight payload is first prebuilt by a sandboxed builder process (:mod:`nnqueue.engines.builders`), and a
prebuilt one's mediators are loaded there once as a check, so one the engine could not load fails its job here.
The engine runs the requests and writes the result to the sinks this worker hands it
(:mod:`nnqueue.engines.trace_runner`, :mod:`nnqueue.workers.sinks`); this process never unpickles a save.
The job fails with the trace's first error (nnsight's type, message and traceback), keeping the other
invokes' saves as its result; a payload that cannot be rebuilt fails naming both sides' versions when
they differ; a request vLLM refuses (``VLLMValidationError``: a prompt over ``max_model_len``) fails with
vLLM's type and message, which the client raises as that type (:mod:`nnqueue.client.errors`).
"""

from __future__ import annotations

import asyncio
import platform
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nnsight
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import trace_payload
from nnqueue.db.models import Job, JobKind
from nnqueue.engines import prebuilt, trace_runner
from nnqueue.engines.builders import BuilderPool, BuildFailed
from nnqueue.engines.outbox import OutboxPoller
from nnqueue.scheduler.payloads import PayloadMissing, load_payload
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore
from nnqueue.workers.job_execution import Execution, JobFailure
from nnqueue.workers.sinks import ResultNotWritten, ResultSinks
from nnqueue.workers.steer_execution import execute_steering

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

    async def execute(self, job: Job, progress: Callable[[int, int], None]) -> Execution:
        if job.kind is JobKind.STEER:  # declarative, on the engine's steering path: no trace to build
            return await execute_steering(self, job, progress)
        try:
            payload = await asyncio.to_thread(load_payload, self.sessions, self.store, job)
        except PayloadMissing as missing:
            raise JobFailure("PayloadMissing", str(missing)) from None
        trace, requests = await self._prepare(job, payload)
        total = len(requests.request_ids)
        progress(0, total)
        sinks = await asyncio.to_thread(self.sinks.open, job.id, job.attempts)
        committed = False
        try:
            try:
                report = await trace_runner.run_trace(
                    self.model,
                    requests,
                    trace_id=f"{job.id}-{job.attempts}",
                    sinks=sinks.specs,
                    outbox=self.outbox,
                    on_finished=lambda done: progress(done, total),
                )
            except RequestRefused as refused:  # vLLM's checks of a request (a prompt over max_model_len)
                raise JobFailure(type(refused).__name__, str(refused)) from None
            failure = _failure(report, job, trace)
            if report.write_error is not None and failure is None:
                raise JobFailure("ResultWriteFailed", f"the engine could not write the result: {report.write_error}")
            stored = None
            if report.write_error is None and (report.objects or failure is None):
                try:
                    stored = await asyncio.to_thread(self.sinks.commit, sinks, report.objects)
                except (ResultNotWritten, OSError, ObjectNotFound) as error:
                    raise JobFailure("ResultWriteFailed", f"the result did not reach the store: {error}") from None
                committed = True
        finally:
            if not committed:
                await asyncio.to_thread(self.sinks.discard, sinks)
        return Execution(total, stored, failure)

    async def close(self) -> None:
        await self.builders.close()
        self.model.vllm_entrypoint.shutdown()

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
                payload = await self.builders.build(payload)  # its mediators checked too
            except BuildFailed as failed:
                raise JobFailure(failed.type_name, rebuild_message(failed.message, job), failed.traceback) from None
        trace = None
        try:
            trace = trace_payload.decode(payload)
            requests = prebuilt.to_requests(trace, f"{job.id}-{job.attempts}")
        except trace_payload.PayloadError as error:
            raise JobFailure(
                "InvalidPayload", rebuild_message(str(error), job, trace), traceback.format_exc()
            ) from None
        if kind == "prebuilt":
            try:
                await self.builders.check(payload)
            except BuildFailed as failed:
                raise JobFailure(
                    failed.type_name, rebuild_message(failed.message, job, trace), failed.traceback
                ) from None
        return trace, requests


def _failure(report: trace_runner.TraceReport, job: Job, trace: trace_payload.PrebuiltTrace) -> JobFailure | None:
    error = report.error
    if error is None or error["is_control_flow"]:
        return None
    message = error["message"]
    if report.load_failed:
        message = rebuild_message(message, job, trace)
    return JobFailure(error["type_name"], message, error["traceback"])


def rebuild_message(error: str, job: Job, trace: trace_payload.PrebuiltTrace | None = None) -> str:
    """The rebuild error, with both sides' versions when the client's differ from the server's.

    The client's versions are the prebuilt payload's own, else what the job's submission reported."""
    client: dict[str, Any] = {}
    if trace is not None and trace.nnsight:
        client = {"nnsight": trace.nnsight, "python": trace.python}
    elif isinstance(job.meta, dict) and isinstance(job.meta.get("client"), dict):
        client = job.meta["client"]
    server = {"nnsight": nnsight.__version__, "python": platform.python_version()}
    message = f"could not rebuild the trace: {error}"
    if client and any(client.get(name) != version for name, version in server.items()):
        message += (
            f" (client nnsight {client.get('nnsight', '?')} / python {client.get('python', '?')},"
            f" server nnsight {server['nnsight']} / python {server['python']})"
        )
    return message
