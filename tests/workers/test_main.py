"""The worker's start-up: the heap made while the engine loaded is frozen out of garbage collection, and the trace
builders start beside the engine, so that they are ready before the worker takes its first job; vLLM is imported
only once the builders are launched, and the supervisor never imports it."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from tests.utils.services import WorkerProcess

pytestmark = pytest.mark.shared_worker  # the start-up test reads the shared worker's log


def test_the_startup_heap_is_out_of_the_collectors_reach() -> None:
    from nnqueue.workers.main import freeze_startup_heap

    startup = [[index] for index in range(10_000)]  # container objects the collector tracks
    before = gc.get_freeze_count()  # an in-process vLLM engine core freezes its own start-up
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= before + len(startup)
        assert not any(obj is startup for obj in gc.get_objects())  # in no generation a collection walks
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("module", ["nnqueue.cli", "nnqueue.workers.supervisor", "nnqueue.workers.main"])
def test_the_worker_and_its_supervisor_import_no_vllm_at_their_top(module: str) -> None:
    """The worker imports vLLM (9-12 s of one core here) only after it launched its trace builders, which load
    beside it (nnqueue.workers.main._start_executor); the supervisor never does."""
    check = f"import sys, {module}; sys.exit(' '.join(n for n in ('vllm', 'nnsight') if n in sys.modules) or None)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
def test_every_trace_builder_is_ready_before_the_worker_takes_jobs(worker: WorkerProcess) -> None:
    """Started on first use, a builder made the first trace job wait 18-39 s (2-core CPU machine) while it loaded its
    meta model; now they load while the engine does, and the worker says how many jobs it runs at once (then
    registers, then takes jobs) only once both of its builders (the default NNQUEUE_TRACE_BUILDERS) are ready."""
    worker.wait_registered()
    lines = worker.log().splitlines()
    taking_jobs = next(index for index, line in enumerate(lines) if "running up to 4 jobs at once" in line)
    builders = [line for line in lines[:taking_jobs] if "trace builder process" in line and " ready (" in line]
    assert len(builders) == 2, "\n".join(lines[: taking_jobs + 1])[-5000:]


@pytest.mark.slow
def test_the_engine_builds_its_compiled_kernel_before_the_worker_takes_jobs(worker: WorkerProcess) -> None:
    """vLLM compiles its logprobs kernel on first use (a C compiler run), which the seccomp filter forbids: built at
    the first step, it cost the first trace job on a fresh worker 2.5-2.7 s (its tenth: 0.23 s end to end on a 2-core
    CPU machine). It is the last part of the engine's start now, logged by the engine process (nnqueue's records
    there are in the worker's format, the shared worker's JSON, and reach its log relayed: records of
    ``nnqueue.output``, never lines of their own)."""
    worker.wait_registered()
    lines = worker.log().splitlines()
    ready = next(index for index, line in enumerate(lines) if "engine for" in line and " ready in " in line)
    built = [line for line in lines[:ready] if "built vLLM's logprobs kernel in" in line]
    assert len(built) == 1, "\n".join(lines[: ready + 1])[-5000:]
    relayed = json.loads(built[0])
    assert relayed["logger"] == "nnqueue.output"
    assert json.loads(relayed["message"])["logger"] == "nnqueue.enginecore.sandbox"
