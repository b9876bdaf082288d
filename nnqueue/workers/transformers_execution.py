"""The transformers executor: a claimed job's raw nnsight payload run by the transformers engine process.

The engine process (:mod:`nnqueue.engines.transformers`) rebuilds and runs the trace and writes its saves to
the job's sinks, which this worker then commits without ever loading them (:mod:`nnqueue.workers.trace_jobs`,
as the vLLM executor does). The per-request environment an nnsight client sent (``meta["ndif"]["env"]``: its
attention implementation) goes with the job. A trace error fails the job with nnsight's type, message and
traceback (a payload that cannot be rebuilt names both sides' versions); an engine process that dies fails the
job it was running with ``EngineDied`` (the next job starts a new one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import Job
from nnqueue.enginecore.child_process import ChildFailed
from nnqueue.engines.trace_report import TraceReport
from nnqueue.engines.transformers import TransformersEngine
from nnqueue.storage.object_store import ObjectStore
from nnqueue.workers.job_execution import Execution, JobFailure
from nnqueue.workers.sinks import ResultSinks
from nnqueue.workers.trace_jobs import PayloadReads, run_and_commit


@dataclass
class TransformersExecutor:
    sessions: sessionmaker[Session]  # small payloads are kept in the database (nnqueue.scheduler.payloads)
    store: ObjectStore
    engine: TransformersEngine
    sinks: ResultSinks
    payloads: PayloadReads = field(init=False)

    def __post_init__(self) -> None:
        self.payloads = PayloadReads(self.sessions, self.store)

    async def execute(self, job: Job, progress: Callable[[int, int], None]) -> Execution:
        payload = await self.payloads.load(job)
        progress(0, 1)

        async def run(sinks: dict[str, Any]) -> TraceReport:
            try:
                return await self.engine.run(f"{job.id}-{job.attempts}", _env(job), payload, sinks)
            except ChildFailed as failed:
                raise JobFailure("EngineDied", str(failed)) from None

        return await run_and_commit(self.sinks, job, 1, run)

    async def close(self) -> None:
        await self.engine.close()

    async def leave_domain(self) -> None:
        """Nothing runs a domain's code beside the engine here: its processes each serve one domain already."""

    async def verify_engine_state(self) -> list[str]:
        """Nothing to do at a trust domain switch: the engine process runs one job at a time and puts back the
        weights and the rest of the state after every job (:mod:`nnqueue.enginecore.transformers_engine`)."""
        return []


def _env(job: Job) -> dict[str, Any]:
    ndif = job.meta.get("ndif") if isinstance(job.meta, dict) else None
    env = ndif.get("env") if isinstance(ndif, dict) else None
    return env if isinstance(env, dict) else {}
