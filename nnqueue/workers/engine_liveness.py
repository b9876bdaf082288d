"""The engine's liveness, as a gauge a liveness probe reads: a hung engine restarts its pod.

A worker whose vLLM engine core hangs inside a step (a wedged GPU, a collective that never returns) neither dies nor
serves: its jobs stop, nothing raises, and the process looks alive. Every :data:`INTERVAL_S` seconds, on the worker's
engine loop, :func:`keep_probing` makes a round trip to the engine core (``AsyncLLM.is_sleeping``, a utility call
the core answers between two steps) and then sets ``nnqueue_worker_engine_responded_timestamp_seconds`` to now. A
stuck core, or an engine loop that no longer runs, stops the gauge; the worker's liveness probe
(deploy/kubernetes/base/worker.yaml) fails once it is older than its threshold, which leaves the longest step
many times over. On the transformers engine, which has no core process, the round trip is the loop's alone. A vLLM
engine that refuses the round trip has died: the probe heals the worker (:mod:`nnqueue.workers.engine_health`) as a
job that finds the engine dead does, so an idle worker's dead engine is replaced within :data:`INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import prometheus_client

from nnqueue.workers.engine_health import EngineHealth

INTERVAL_S = 10.0
RESPONDED = prometheus_client.Gauge(
    "nnqueue_worker_engine_responded_timestamp_seconds",
    "When the worker's engine last answered a round trip (Unix time); it stops moving when the engine hangs.",
    ["model"],
)


async def keep_probing(
    model_key: str,
    entrypoint: Callable[[], Any] | None,
    health: EngineHealth | None = None,
    interval_s: float = INTERVAL_S,
) -> None:
    """Until cancelled: ask the engine (``entrypoint()``: the vLLM ``AsyncLLM`` serving now; None: the loop alone)
    and mark the answer's time. A refusal that says the engine died heals the worker through ``health``, as a job's
    does (it starts a fresh engine, whose answers mark again, or stops the worker), so an engine that died with no
    job on it (the OOM killer's) is replaced without waiting for a job to find it dead. A round trip waits at most
    ``interval_s``: one pending when the engine died is never answered (vLLM 0.32's client fails a dead engine's
    requests, not its utility calls), and the probe would otherwise wait on it for good, blind to every later death;
    one that times out on a live engine (a long step) only leaves the gauge, and the next round asks again."""
    gauge = RESPONDED.labels(model_key)
    while True:
        generation = health.generation if health is not None else 0  # the engine asked
        try:
            if entrypoint is not None:
                await asyncio.wait_for(entrypoint().is_sleeping(), interval_s)
        except Exception as error:  # noqa: BLE001 - a death is healed; any other failure only leaves the gauge
            if health is not None and health.caused_by_death(error):
                await health.engine_died(generation)
        else:
            gauge.set_to_current_time()
        await asyncio.sleep(interval_s)
