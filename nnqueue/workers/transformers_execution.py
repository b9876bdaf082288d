"""The transformers executor: a claimed job's raw nnsight payload run by the transformers engine process.

The engine process (:mod:`nnqueue.engines.transformers`) rebuilds and runs the trace and writes its saves to
the job's sinks (:mod:`nnqueue.workers.sinks`), which this worker then commits without ever loading them. The
per-request environment an nnsight client sent (``meta["ndif"]["env"]``: its attention implementation) goes
with the job. A trace error fails the job with nnsight's type, message and traceback (a payload that cannot be
rebuilt names both sides' versions); an engine process that dies fails the job it was running (the next job
starts a new one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import Job
from nnqueue.engines.transformers import EngineFailed, TransformersEngine
from nnqueue.scheduler.payloads import PayloadMissing, load_payload
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore
from nnqueue.workers.job_execution import Execution, JobFailure
from nnqueue.workers.sinks import ResultNotWritten, ResultSinks
from nnqueue.workers.trace_execution import rebuild_message


@dataclass
class TransformersExecutor:
    sessions: sessionmaker[Session]  # small payloads are kept in the database (nnqueue.scheduler.payloads)
    store: ObjectStore
    engine: TransformersEngine
    sinks: ResultSinks

    async def execute(self, job: Job, progress: Callable[[int, int], None]) -> Execution:
        try:
            payload = await asyncio.to_thread(load_payload, self.sessions, self.store, job)
        except PayloadMissing as missing:
            raise JobFailure("PayloadMissing", str(missing)) from None
        progress(0, 1)
        sinks = await asyncio.to_thread(self.sinks.open, job.id, job.attempts)
        committed = False
        try:
            try:
                ran = await self.engine.run(f"{job.id}-{job.attempts}", _env(job), payload, sinks.specs)
            except EngineFailed as failed:
                raise JobFailure("EngineDied", str(failed)) from None
            failure = None
            if ran.error is not None and not ran.error["is_control_flow"]:
                message = rebuild_message(ran.error["message"], job) if ran.load_failed else ran.error["message"]
                failure = JobFailure(ran.error["type_name"], message, ran.error["traceback"])
            stored = None
            if ran.objects:  # a failed trace saved nothing: nnsight stops the whole forward at the error
                try:
                    stored = await asyncio.to_thread(self.sinks.commit, sinks, ran.objects)
                except (ResultNotWritten, OSError, ObjectNotFound) as error:
                    raise JobFailure("ResultWriteFailed", f"the result did not reach the store: {error}") from None
                committed = True
            elif failure is None:
                raise JobFailure("ResultWriteFailed", "the engine reported no result")
        finally:
            if not committed:
                await asyncio.to_thread(self.sinks.discard, sinks)
        return Execution(1, stored, failure)

    async def close(self) -> None:
        await self.engine.close()


def _env(job: Job) -> dict[str, Any]:
    ndif = job.meta.get("ndif") if isinstance(job.meta, dict) else None
    env = ndif.get("env") if isinstance(ndif, dict) else None
    return env if isinstance(env, dict) else {}
