"""Run a trace's vLLM requests on a dispatched async ``VLLM`` engine; the engine writes its result.

The requests come ready-made (:mod:`nnqueue.engines.prebuilt`): nnsight's mediator bytes already sit in
each request's ``extra_args``, so nothing is deserialized or re-serialized here. `run_trace` submits them
together and, once all have finished, makes one RPC, ``nnqueue_finish_trace``, with the finished outputs
(which serve ``tracer.result``) and the sinks to write to: the engine collects and merges the saves in its
own process and writes them (:mod:`nnqueue.enginecore.rpc`). The outcome (written objects, the trace's
first error as nnsight's deferred-error dict) comes back through the outbox and is validated here, because
the engine process runs users' code.

Aborting: ``AsyncLLM.abort(request_ids)`` (`abort_trace`) ends the requests with whatever they saved so
far; cancelling the task running `run_trace` aborts them and frees their state on the engine
(``nnqueue_discard_trace``), so a cancelled or timed-out job leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nnqueue.engines.outbox import OutboxPoller
from nnqueue.engines.prebuilt import TraceRequests
from nnqueue.errors import NNqueueError

MAX_ERROR_TEXT = 64 * 1024
SHA256 = re.compile(r"[0-9a-f]{64}")

# Strong references to in-flight cleanups (asyncio holds tasks weakly).
_cleanups: set[asyncio.Task[Any]] = set()


class InvalidReport(NNqueueError, ValueError):
    """The engine's report of a trace's result was malformed."""


@dataclass(frozen=True)
class WrittenObject:
    size: int
    sha256: str


@dataclass(frozen=True)
class TraceReport:
    """What the engine reported about a finished trace."""

    error: dict[str, Any] | None  # nnsight's DeferredError: type_name, message, traceback, is_control_flow
    load_failed: bool  # the error is a mediator this engine could not load
    objects: dict[str, WrittenObject]  # written sinks by name ("torch", "safetensors")
    write_error: str | None


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
                outputs[request_id] = output  # the last one is the finished one
            if on_finished is not None:
                on_finished(len(outputs))

        try:
            async with asyncio.TaskGroup() as group:
                for request_id, prompt, params in zip(trace.request_ids, trace.prompts, trace.params, strict=True):
                    group.create_task(one(request_id, prompt, params))
        except BaseExceptionGroup as failures:
            raise failures.exceptions[0] from None
        report = outbox.expect(trace_id)
        try:
            await engine.collective_rpc(
                "nnqueue_finish_trace", args=(trace_id, trace.request_ids, pickle.dumps(outputs), sinks)
            )
        except BaseException:
            report.cancel()
            raise
        finished = True
        return parse_report(await report)
    finally:
        if not finished:
            # Aborted, cancelled or failed before the engine took the trace over: free its requests'
            # state there. A shielded task, so our own cancellation cannot stop it.
            cleanup = asyncio.ensure_future(engine.collective_rpc("nnqueue_discard_trace", args=(trace.request_ids,)))
            _cleanups.add(cleanup)
            cleanup.add_done_callback(_cleanups.discard)
            await asyncio.shield(cleanup)


async def abort_trace(model: Any, request_ids: list[str]) -> None:
    """Abort a running trace's requests. Each request's stream then ends with a finished ``abort`` output,
    so `run_trace` goes on to write whatever was saved so far (typically with an error for a block that
    never reached the location it waited on). Ids not (or no longer) in flight are ignored."""
    await model.vllm_entrypoint.abort(request_ids)


def parse_report(entry: dict[str, Any]) -> TraceReport:
    """Validate a ``trace_result`` outbox entry (see :mod:`nnqueue.enginecore.trace_results`)."""
    if entry.get("kind") != "trace_result":
        raise InvalidReport(f"expected a trace_result, got {entry.get('kind')!r}")
    objects = {}
    raw_objects = entry.get("objects")
    if not isinstance(raw_objects, dict):
        raise InvalidReport("objects must be a dict")
    for name, raw in raw_objects.items():
        if not (
            isinstance(raw, dict)
            and isinstance(raw.get("size"), int)
            and raw["size"] >= 0
            and isinstance(raw.get("sha256"), str)
            and SHA256.fullmatch(raw["sha256"])
        ):
            raise InvalidReport(f"object {name!r} must be {{size, sha256}}")
        objects[name] = WrittenObject(raw["size"], raw["sha256"])
    write_error = entry.get("write_error")
    if write_error is not None and not isinstance(write_error, str):
        raise InvalidReport("write_error must be a string or null")
    return TraceReport(
        error=_deferred_error(entry.get("error")),
        load_failed=entry.get("load_failed") is True,
        objects=objects,
        write_error=None if write_error is None else write_error[:MAX_ERROR_TEXT],
    )


def _deferred_error(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidReport("error must be a dict or null")
    error: dict[str, Any] = {"is_control_flow": raw.get("is_control_flow") is True}
    for name, default in (("type_name", "Exception"), ("message", ""), ("traceback", "")):
        value = raw.get(name, default)
        if not isinstance(value, str):
            raise InvalidReport(f"error.{name} must be a string")
        error[name] = value[:MAX_ERROR_TEXT]
    return error
