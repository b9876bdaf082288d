"""Run a trace's vLLM requests on a dispatched async ``VLLM`` engine; the engine writes its result.

The requests come ready-made (:mod:`nnqueue.engines.prebuilt`): nnsight's mediator bytes already sit in
each request's ``extra_args``, so nothing is deserialized or re-serialized here. `run_trace` submits them
together and, once all have finished, calls ``nnqueue_finish_trace`` with the finished outputs (which serve
``tracer.result``) and the sinks to write to, grouped with the other jobs' calls of the moment in one RPC
(:meth:`nnqueue.engines.outbox.OutboxPoller.call`): the engine collects and merges the saves in its own process
and writes them (:mod:`nnqueue.enginecore.rpc`). The outcome (written objects, the trace's
first error as nnsight's deferred-error dict) comes back through the outbox and is validated
(:mod:`nnqueue.engines.trace_report`), because the engine process runs users' code.

Aborting: ``AsyncLLM.abort(request_ids)`` (`abort_trace`) ends the requests with whatever they saved so
far; cancelling the task running `run_trace` aborts them and frees their state on the engine
(``nnqueue_discard_trace``), so a cancelled or timed-out job leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable
from typing import Any

from nnqueue.engines.outbox import OutboxPoller
from nnqueue.engines.prebuilt import TraceRequests
from nnqueue.engines.trace_report import TraceReport, parse_report
from nnqueue.timeline import stamp

# Strong references to in-flight cleanups (asyncio holds tasks weakly).
_cleanups: set[asyncio.Task[Any]] = set()


async def run_trace(
    model: Any,
    trace: TraceRequests,
    *,
    trace_id: str,
    sinks: dict[str, Any],
    outbox: OutboxPoller,
    on_finished: Callable[[int], None] | None = None,
) -> TraceReport:
    """Submit the trace's requests, wait for all, and have the engine write the result to ``sinks``.

    ``on_finished(n)`` is called as the n-th request finishes. Engine failures (``EngineDeadError``,
    ``EngineGenerateError``) propagate after the trace's requests are aborted and freed.
    """
    engine = model.vllm_entrypoint
    outputs: dict[str, Any] = {}
    finished = False
    try:

        async def one(request_id: str, prompt: Any, params: Any) -> None:
            async for output in engine.generate(prompt, params, request_id):
                stamp("first_output")
                outputs[request_id] = output  # the last one is the finished one
            if on_finished is not None:
                on_finished(len(outputs))

        stamp("submitted")
        try:
            async with asyncio.TaskGroup() as group:
                for request_id, prompt, params in zip(trace.request_ids, trace.prompts, trace.params, strict=True):
                    group.create_task(one(request_id, prompt, params))
        except BaseExceptionGroup as failures:
            raise failures.exceptions[0] from None
        stamp("last_output")
        report = outbox.expect(trace_id)
        try:
            await outbox.call("nnqueue_finish_trace", trace_id, trace.request_ids, pickle.dumps(outputs), sinks)
        except BaseException:
            report.cancel()
            raise
        finished = True
        written = await report
        stamp("written")
        return parse_report(written)
    finally:
        if not finished:
            # Aborted, cancelled or failed before the engine took the trace over: free its requests'
            # state there. A shielded task, so our own cancellation cannot stop it.
            cleanup = asyncio.ensure_future(outbox.call("nnqueue_discard_trace", trace.request_ids))
            _cleanups.add(cleanup)
            cleanup.add_done_callback(_cleanups.discard)
            await asyncio.shield(cleanup)


async def abort_trace(model: Any, request_ids: list[str]) -> None:
    """Abort a running trace's requests. Each request's stream then ends with a finished ``abort`` output,
    so `run_trace` goes on to write whatever was saved so far (typically with an error for a block that
    never reached the location it waited on). Ids not (or no longer) in flight are ignored."""
    await model.vllm_entrypoint.abort(request_ids)
