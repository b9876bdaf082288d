"""vLLM's multiprocessing executor, with the engine core's own process sandboxed like its model-runner workers.

With tensor or pipeline parallelism (vLLM's ``mp`` executor, ``vllm.v1.executor.multiproc_executor``) the engine
core runs no model: it spawns one model-runner worker per rank, broadcasts each step to them and reads their
outputs back through shared-memory queues, which it unpickles. Users' code runs in the workers, each switched to
the engine user at its first step (:class:`nnqueue.enginecore.sandbox.SandboxedWorker`); but code that took a
worker over could write what the engine core unpickles next, so the engine core must hold no more than the
workers. :class:`SandboxedMultiprocExecutor` (the worker passes it as ``distributed_executor_backend``, which
vLLM accepts as a class) enters the same sandbox in the engine core at its first step, before the step is
broadcast: the engine user, the privileged-threads check and the seccomp filter.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from nnqueue.enginecore.sandbox import enter_engine_sandbox


class SandboxedMultiprocExecutor(MultiprocExecutor):
    _nnqueue_sandboxed = False

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        if not self._nnqueue_sandboxed:
            enter_engine_sandbox(hand_over=[], jit_compiler=False, protected_environment=False)
            self._nnqueue_sandboxed = True
        return super().execute_model(*args, **kwargs)
