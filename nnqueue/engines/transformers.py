"""The worker's side of the transformers engine: the engine process, started, fed one job at a time, replaced.

The engine process (:mod:`nnqueue.enginecore.transformers_engine`) holds the Hugging Face model and runs
users' code: it is a child process of :mod:`nnqueue.enginecore.child_process` (spawned fresh, its environment
without the worker's secrets, sandboxed once its model is loaded). It writes each job's result to the handoff
files it is given (:mod:`nnqueue.workers.sinks`) and answers with the report a vLLM engine gives for a trace
(:mod:`nnqueue.engines.trace_report`), whose sizes the caller checks when it uploads the files.

A job the caller abandons (its timeout passed, it was cancelled: its code may be stuck) kills the process,
and so does a protocol error; the next job starts a new one (loading the model again). A process that dies
by itself fails only the job it was running.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nnqueue.enginecore import transformers_engine as wire
from nnqueue.enginecore.child_process import ChildError, ChildPool
from nnqueue.engines.trace_report import TraceReport, parse_report

READY_TIMEOUT_S = 1800.0
MAX_ANSWER_BYTES = 1 << 24


class TransformersEngine:
    """One engine process for ``model``, started on first use; use it from one event loop, one job at a time."""

    def __init__(self, model: str, model_kwargs: dict[str, Any], stall_timeout_s: float) -> None:
        command = [sys.executable, "-m", "nnqueue.enginecore.transformers_engine", "--model", model]
        command += ["--model-kwargs", json.dumps(model_kwargs), "--stall-timeout-s", str(stall_timeout_s)]
        self._process = ChildPool(
            "transformers engine", command, 1, ready_timeout_s=READY_TIMEOUT_S, max_answer_bytes=MAX_ANSWER_BYTES
        )

    async def start(self) -> None:
        """Start the engine process now (rather than at the first job) and wait until its model is loaded."""
        await self._process.start()

    async def run(self, job_id: str, env: dict[str, Any], payload: bytes, sinks: dict[str, Any]) -> TraceReport:
        """Run one job, its result written to ``sinks``; raises
        :class:`~nnqueue.enginecore.child_process.ChildFailed` when the process fails it. Cancelling kills the
        process."""
        body = wire.job_frame({"job": job_id, "env": env, "sinks": sinks}, payload)
        try:
            return await self._process.call(
                body, f"while running job {job_id}", lambda answer: parse_report(json.loads(answer))
            )
        except ChildError as failed:  # the engine could not write the result
            return TraceReport(error=None, load_failed=False, objects={}, write_error=str(failed))

    async def close(self) -> None:
        await self._process.close()
