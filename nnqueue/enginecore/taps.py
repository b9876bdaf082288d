"""CUDA-graph taps on a worker's engine: which locations it serves, published, and a clear error for any other.

nnsight 0.8.1 lets a ``VLLM`` replay CUDA graphs at the cost of declaring up front which locations a trace
may touch: ``VLLM(..., taps=["model.layers.*.output"])`` resolves the patterns against the module tree
(``VLLM._resolve_taps``: full locations under the root envoy, ``model.model.layers.3.output``), turns on
vLLM's breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``) and builds the engine without
``enforce_eager``. Its ``VLLMInterleaver`` records the handoff at each tap into the graph while vLLM captures
it (``BreakableCUDAGraphCapture.add_eager``), so a replayed step serves the taps, and it skips every other
module location on every step, so what a trace sees never depends on whether its step was replayed.

A block parked on a location outside the taps is never served; nnsight reports it when its request ends
(``Requests.finish_dangling``) with advice for a local user (declare the tap at construction). On nnqueue the
worker, not the trace, declares the taps (``nnqueue worker --taps``), so `unwind_untapped` reports it
first, the way nnsight does (the error thrown into the block, kept as the request's deferred error, so the
job ends FAILED), naming the location and the taps this worker serves.

The worker publishes its taps in its capture points (`mark_taps`: a ``"tap"`` flag on each point that is a
tap), so the API's model list (`served_taps`) and the client know them. A tap must be one of the engine's
capture points: a module's input or output, whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nnqueue.errors import NNqueueError

# The last part of a module location (nnsight's provider names); an eproperty (logits, samples) has none.
MODULE_SIDES = ("input", "output", "skip")
ROOT = "model."  # the root envoy's path, ahead of every resolved tap


class UnservableTaps(NNqueueError, ValueError):
    """A worker was asked for taps it cannot serve and publish (a configuration error: it does not start)."""


def untapped(location: str, taps: Iterable[str]) -> bool:
    """Whether ``location`` is a module location a tapped engine does not serve (no taps: it serves all)."""
    taps = frozenset(taps)
    return bool(taps) and location not in taps and location.rsplit(".", 1)[-1] in MODULE_SIDES


def untapped_message(location: str, taps: Iterable[str]) -> str:
    served = sorted(relative(tap) for tap in taps)
    return (
        f"{relative(location)!r} is not a tap of this worker: it replays CUDA graphs and serves only the"
        f" locations it declared, {served}. Touch only those in a trace for this model, or run it on a worker"
        " started without --taps (eager), which serves every location."
    )


def unwind_untapped(mediator: Any, taps: Iterable[str]) -> None:
    """If ``mediator``'s block is parked on a location outside ``taps``, end it with `untapped_message`.

    As nnsight's ``Requests.finish_dangling`` ends a parked block: the error is thrown into its greenlet
    (on the runner's thread, where the greenlet can be resumed), and what comes out is the request's deferred
    error (``mediator.nnsight_error``). The block is then dead, so nnsight's own pass leaves it alone.
    """
    from greenlet import error as greenlet_error
    from nnsight.intervention.errors import capture_exception
    from nnsight.intervention.interleaver import OutOfOrderError

    if mediator is None or not mediator.alive:
        return
    requester = mediator.pending
    if requester is None or not untapped(requester.provider, taps):
        return
    try:
        mediator.worker.throw(OutOfOrderError(untapped_message(requester.provider, taps)))
    except greenlet_error:
        return
    except BaseException as thrown:  # noqa: BLE001 - what the block let out is its request's error
        mediator.nnsight_error = capture_exception(thrown)


def relative(location: str) -> str:
    """A full location (``model.model.layers.3.output``) as the user writes a tap (``model.layers.3.output``)."""
    return location.removeprefix(ROOT)


def mark_taps(points: list[dict[str, Any]], taps: Iterable[str]) -> list[dict[str, Any]]:
    """The capture points, each with ``"tap"``: whether the engine serves it under graph replay.

    Raises `UnservableTaps` naming any tap that is no capture point (a source operation, a token-id input, a
    value split across tensor-parallel ranks): nnqueue serves and publishes taps on captured values only.
    """
    wanted = {relative(tap) for tap in taps}
    marked = [{**point, "tap": f"{point['module']}.{point['io']}" in wanted} for point in points]
    missing = wanted - {f"{point['module']}.{point['io']}" for point in marked if point["tap"]}
    if missing:
        raise UnservableTaps(
            f"--taps {sorted(missing)} are not values this worker can serve: a tap must be a module's input or"
            " output that a harvest could capture, e.g. 'model.layers.*.output'"
        )
    return marked


def served_taps(points: list[dict[str, Any]] | None) -> list[str] | None:
    """The taps a worker published in its capture points, or None when it serves every location (eager)."""
    taps = [f"{point['module']}.{point['io']}" for point in points or [] if point.get("tap")]
    return taps or None
