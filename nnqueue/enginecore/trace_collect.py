"""A finished trace's saves, collected from nnsight's runner state in the engine and merged as nnsight merges them.

nnsight's own paths fetch each request's saves with ``collect_nnsight``, which pickles them out of the
engine, and merge them in the client (``VLLM._collect``, then ``VLLMTracer.execute`` pushes them into the
trace's frame). Here both halves run in the engine process, on the model runner's thread, with no pickling:

* per request, the steps of nnsight 0.8.1's ``NNsightGPUModelRunner.collect_nnsight`` for a traced request:
  serve ``tracer.result`` with the finished output, unwind a block still parked (its deferred error; one
  parked outside a tapped engine's taps is told which it serves, :mod:`nnqueue.enginecore.taps`), read
  the saved names, forget their ids in the save set, and drop the request's runner state;
* across the trace, ``VLLM._collect``'s merge: containers saved at trace level merge across requests
  (nnsight's ``merge_shared_saves``), a name saved by several runs (invokes, or ``n`` sequences) becomes a
  list in request order unless every run saved the same object, and the first real error of the trace, in
  request order, is its error (a ``tracer.stop()`` is control flow and is not).

The result is the ``{name: value}`` a local run pushes into the trace's variables, plus that error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnqueue.enginecore.taps import unwind_untapped


@dataclass
class _Invoke:
    sequences: dict[int, dict[str, Any]] = field(default_factory=dict)
    mediators: list[Any] = field(default_factory=list)
    error: dict[str, Any] | None = None
    # The request's mediator never loaded: its payload could not be rebuilt in this engine.
    load_failed: bool = False


@dataclass
class CollectedTrace:
    saves: dict[str, Any]
    error: dict[str, Any] | None  # nnsight's DeferredError of the first failing invoke
    load_failed: bool


def collect_trace(runner: Any, request_ids: list[str], outputs: dict[str, Any] | None) -> CollectedTrace:
    """Collect and merge the trace made of ``request_ids`` (its invokes, in order), freeing their state.

    ``runner`` is nnsight's model runner; ``outputs`` maps request id to its finished ``RequestOutput``
    (for ``tracer.result``). Every request named must have finished.
    """
    from nnsight.modeling.vllm.collect import merge_shared_saves

    invokes = _take(runner, request_ids, outputs)
    per_request: list[dict[str, Any]] = []
    values: dict[str, list[Any]] = {}
    for request_id in request_ids:
        invoke = invokes.get(request_id)
        sequences = [invoke.sequences[index] for index in sorted(invoke.sequences)] if invoke else []
        sequences = sequences or [{}]
        per_request.append(sequences[0])
        for saves in sequences:
            for name, value in saves.items():
                values.setdefault(name, []).append(value)

    mediators = [mediator for invoke in invokes.values() for mediator in invoke.mediators]
    shared = merge_shared_saves(mediators, per_request)
    merged: dict[str, Any] = {}
    for name, found in values.items():
        value = found[0]
        if name in shared:
            value = shared[name]
        elif len(found) > 1 and any(other is not value for other in found):
            value = found
        merged[name] = value

    failing = [invokes[request_id] for request_id in request_ids if _failed(invokes.get(request_id))]
    first = failing[0] if failing else None
    return CollectedTrace(merged, first.error if first else None, bool(first and first.load_failed))


def _failed(invoke: _Invoke | None) -> bool:
    """Whether the invoke raised a real error (a ``tracer.stop()`` is control flow, not an error)."""
    return invoke is not None and invoke.error is not None and not invoke.error.get("is_control_flow")


def release(runner: Any, request_ids: list[str]) -> None:
    """Free the runner state of requests that will never be collected (aborted, cancelled, timed out)."""
    from nnsight.tracing.tracer import _saves

    requests = runner.nnsight_requests
    wanted = set(request_ids)
    requests.harvest(wanted)
    saved = _saves()
    for request in list(requests.requests.values()):
        if not request.named(wanted):
            continue
        if request.mediator is not None:
            requests.finish_dangling(request.mediator, quiet=True)
            for value in request.saves().values():
                saved.discard(id(value))
        request.copies = {}
        requests.requests.pop(request.id, None)


def _take(runner: Any, request_ids: list[str], outputs: dict[str, Any] | None) -> dict[str, _Invoke]:
    """Each named request's saves per sequence, mediators and error (collect_nnsight's loop, unpickled)."""
    from nnsight.tracing.tracer import _saves

    requests = runner.nnsight_requests
    wanted = set(request_ids)
    # Registered blocks' copies end with their request (nnqueue installs none; this only unwinds them).
    requests.harvest(wanted)
    taps = runner.nnsight_model.interleaver.taps
    saved = _saves()
    invokes: dict[str, _Invoke] = {}
    for request in list(requests.requests.values()):
        if not request.named(wanted):
            continue
        engine_id, index = request.key(wanted)
        invoke = invokes.setdefault(engine_id, _Invoke())
        request.harvested = {}
        mediator = request.mediator
        values: dict[str, Any] = {}
        if mediator is not None:
            if outputs and engine_id in outputs:
                requests.serve_result(mediator, outputs[engine_id])
            unwind_untapped(mediator, taps)  # parked outside a tapped engine's taps: say which it serves
            requests.finish_dangling(mediator, taps)
            values = request.saves()
            invoke.mediators.append(mediator)
            for value in values.values():
                saved.discard(id(value))
        invoke.sequences[index] = values
        if invoke.error is None:
            invoke.error = request.deferred()
            invoke.load_failed = mediator is None and request.error is not None
        if not request.copies:
            requests.requests.pop(request.id, None)
    return invokes
