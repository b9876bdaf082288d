"""Run serialized nnsight traces on a dispatched async ``VLLM`` engine.

A payload is ``RequestModel.serialize(tracer)`` bytes, written by a client against a meta
model. This reproduces nnsight 0.8.1's ``nnsight.modeling.vllm.serve.server.generate``
minus the HTTP: rebuild the tracer, build one vLLM request per invoke with its worker
serialized into ``SamplingParams.extra_args``, submit them to the ``AsyncLLM``, and
collect each finished request's saves from the engine worker (``acollect``).

Results use nnsight-serve's shape: saves merged by name across invokes (a later invoke
wins a clash) and the first error as an nnsight deferred error, which a client re-raises
with ``nnsight.intervention.errors.raise_deferred``.

Aborting: ``AsyncLLM.abort(request_ids)`` with the external ids used here (`abort_trace`),
or simply cancel the task running `run_trace`: vLLM aborts a request whose ``generate``
stream is cancelled, and `run_trace` then frees its worker on the engine.
"""

from __future__ import annotations

import ast
import asyncio
import linecache
import threading
from dataclasses import dataclass
from typing import Any

from nnsight.intervention.errors import DeferredError, capture_exception
from nnsight.modeling.vllm import VLLM
from nnsight.modeling.vllm.engines.engine import acollect
from nnsight.schema.request import RequestModel

# Held for the whole build. Builds must not interleave: each one appends its workers to the
# model's single interleaver, and deserialize registers the trace's source in the
# process-global linecache under the client's filename, which the build then reads back.
BUILD_LOCK = threading.Lock()

# Strong references to in-flight cleanups (asyncio holds tasks weakly).
_cleanups: set[asyncio.Task[Any]] = set()


@dataclass(frozen=True)
class BuiltTrace:
    """One trace's vLLM requests, ready to submit: one per invoke, workers attached."""

    request_ids: list[str]
    prompts: list[Any]
    params: list[Any]
    lora_requests: list[Any]


@dataclass
class TraceResult:
    saves: dict[str, Any]
    error: DeferredError | None


def build_trace(model: VLLM, payload: bytes, request_id_prefix: str) -> BuiltTrace:
    """Rebuild a serialized trace against ``model`` and turn it into requests.

    Synchronous and under `BUILD_LOCK`: there must be no ``await`` in here. Raises whatever
    the payload raises (a corrupt or incompatible trace, a bad sampling argument).
    Request ids are ``f"{request_id_prefix}-{invoke index}"``; the prefix must be unique
    among requests in flight on this engine.
    """
    with BUILD_LOCK:
        try:
            tracer = RequestModel.deserialize(payload, model._remoteable_persistent_objects())
            # Deserialize drops the AST node, which `_attach_mediators` needs to re-serialize
            # the workers; parse it back from the source deserialize just put in linecache.
            source = "".join(linecache.getlines(tracer.info.frame.f_code.co_filename))
            tracer.node = ast.parse(source)
            _, (prompts, params, lora_requests), forward_kwargs = tracer.prepare(tracer.info.code)
            model._attach_mediators(params, **forward_kwargs)
        finally:
            # The workers now ride on `params`; clear them (also after a failed build, or
            # they would bleed into the next one).
            model.interleaver.cancel()
    request_ids = [f"{request_id_prefix}-{index}" for index in range(len(prompts))]
    return BuiltTrace(request_ids, prompts, params, lora_requests)


async def _run_request(
    engine: Any, request_id: str, prompt: Any, params: Any, lora_request: Any
) -> dict[str, Any] | None:
    """Drive one request to its finished output and collect its entry from the worker."""
    collected = False
    try:
        output = None
        # B007: the loop only runs the stream; its last (finished) output is used below.
        async for output in engine.generate(prompt, params, request_id, lora_request=lora_request):  # noqa: B007
            pass
        # The finished output goes back to the worker, which needs it to serve `tracer.result`.
        entry = await acollect(engine, request_id, output)
        collected = True
        return entry
    finally:
        if not collected:
            # Cancelled or failed before collecting: free the worker, which vLLM's abort
            # leaves on the engine. A shielded task, so our own cancellation can't stop it.
            cleanup = asyncio.ensure_future(acollect(engine, request_id))
            _cleanups.add(cleanup)
            cleanup.add_done_callback(_cleanups.discard)
            await asyncio.shield(cleanup)


async def run_trace(model: VLLM, trace: BuiltTrace) -> TraceResult:
    """Submit a built trace's requests together and gather their saves.

    Engine failures (``EngineDeadError``, ``EngineGenerateError``) propagate; the other
    requests of the trace are then cancelled, i.e. aborted and freed.
    """
    engine = model.vllm_entrypoint
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(_run_request(engine, request_id, prompt, params, lora))
                for request_id, prompt, params, lora in zip(
                    trace.request_ids, trace.prompts, trace.params, trace.lora_requests, strict=True
                )
            ]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None  # the first failure itself, not the group around it

    saves: dict[str, Any] = {}
    error: DeferredError | None = None
    for task in tasks:
        entry = task.result()
        if entry is None:
            continue
        saves.update(entry["saves"])
        error = error or entry["error"]
    return TraceResult(saves, error)


async def run_serialized_trace(model: VLLM, payload: bytes, request_id_prefix: str) -> TraceResult:
    """`build_trace` then `run_trace`; a build failure comes back as the result's error."""
    try:
        trace = build_trace(model, payload, request_id_prefix)
    except Exception as exception:  # noqa: BLE001 - a payload fails to rebuild in any way; it is the trace's error
        return TraceResult({}, capture_exception(exception))
    return await run_trace(model, trace)


async def abort_trace(model: VLLM, request_ids: list[str]) -> None:
    """Abort a running trace's requests by the ids `build_trace` gave them.

    Each request's stream then ends with a finished ``abort`` output, so `run_trace`
    returns (collecting and freeing the workers) with whatever was saved so far and,
    typically, an error for a worker that never reached the locations it waited on.
    Ids not (or no longer) in flight are ignored.
    """
    await model.vllm_entrypoint.abort(request_ids)
