"""What both trace executors do around their engine: a claimed job's payload in, its result committed, its
error mapped.

The vLLM executor (:mod:`nnqueue.workers.trace_execution`) and the transformers one
(:mod:`nnqueue.workers.transformers_execution`) differ in how their engine runs a trace, not in what comes
before and after: the payload is read from wherever it is kept (:mod:`nnqueue.scheduler.payloads`; `PayloadReads`
reads the payloads the database keeps for the jobs claimed together in one query); the engine
writes the result to the attempt's handoff files (:mod:`nnqueue.workers.sinks`) and reports it
(:mod:`nnqueue.engines.trace_report`); this worker uploads what the engine reported writing, and removes what
an attempt that commits nothing left behind. The job fails with the trace's first error (nnsight's type,
message and traceback; a payload that cannot be rebuilt names both sides' versions when they differ),
keeping the other invokes' saves as its result, or with ``ResultWriteFailed`` when the result did not reach
the store.
"""

from __future__ import annotations

import asyncio
import platform
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import nnsight
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import trace_payload
from nnqueue.db.models import Job
from nnqueue.engines.trace_report import TraceReport
from nnqueue.scheduler.payloads import PayloadMissing, load_inline, load_payload
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore
from nnqueue.timeline import stamp
from nnqueue.workers.grouped_calls import GroupedCalls
from nnqueue.workers.job_execution import Execution, JobFailure
from nnqueue.workers.sinks import ResultNotWritten, ResultSinks, ResultTooLarge


class PayloadReads:
    """Claimed jobs' payloads, in I/O threads; a missing one fails its job. The payloads the database keeps (small
    ones, most jobs') are read together: one query for the jobs that ask while one is in flight, as the jobs claimed
    together do (a session, a query and a thread hop per job were as many as the claims they followed); those in
    the object store each in a thread of its own, in parallel."""

    def __init__(self, sessions: sessionmaker[Session], store: ObjectStore) -> None:
        self.sessions, self.store = sessions, store
        self._inline: GroupedCalls[uuid.UUID, bytes] = GroupedCalls(self._read_inline)

    async def load(self, job: Job) -> bytes:
        try:
            if job.payload_key is None:
                return await self._inline(job.id)
            return await asyncio.to_thread(load_payload, self.sessions, self.store, job)
        except PayloadMissing as missing:
            raise JobFailure("PayloadMissing", str(missing)) from None

    def _read_inline(self, job_ids: list[uuid.UUID]) -> list[bytes | PayloadMissing]:
        found = load_inline(self.sessions, job_ids)
        missing = "the job's payload is not in the database (job_payloads, job {})"
        return [found[job_id] if job_id in found else PayloadMissing(missing.format(job_id)) for job_id in job_ids]


async def run_and_commit(
    sinks: ResultSinks,
    job: Job,
    units: int,
    run: Callable[[dict[str, Any]], Awaitable[TraceReport]],
    trace: trace_payload.PrebuiltTrace | None = None,
) -> Execution:
    """Open the attempt's sinks, ``run`` the engine with their specs, commit what it reports writing; the job's
    execution, ``units`` long. ``trace``: the prebuilt payload, whose versions a rebuild error names."""
    async with sinks.staged_result(job.id, job.attempts, safetensors=job.wants_safetensors) as handoff:
        report = await run(handoff.specs)
        failure = trace_failure(report, job, trace)
        if report.write_error is not None and failure is None:
            raise JobFailure("ResultWriteFailed", f"the engine could not write the result: {report.write_error}")
        stored = None
        # A failed trace has a result only when its other invokes saved something.
        if report.write_error is None and (report.objects or failure is None):
            try:
                stored = await asyncio.to_thread(sinks.commit, handoff, report.objects)
            except ResultTooLarge as error:
                raise JobFailure("ResultTooLarge", str(error)) from None
            except (ResultNotWritten, OSError, ObjectNotFound) as error:
                raise JobFailure("ResultWriteFailed", f"the result did not reach the store: {error}") from None
            stamp("committed")
    return Execution(units, stored, failure)


def trace_failure(report: TraceReport, job: Job, trace: trace_payload.PrebuiltTrace | None = None) -> JobFailure | None:
    """The job's failure for the trace's first error (none for a control-flow one: ``tracer.stop()``)."""
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
