"""nnsight's CUDA worker, plus nnqueue's stall watchdog (see :mod:`nnqueue.enginecore.stall_watchdog`) and RPC methods."""

from __future__ import annotations

from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from nnqueue.enginecore import lifetime, stall_watchdog
from nnqueue.enginecore.rpc import NNqueueRPC
from nnqueue.settings import Settings


class NNqueueGPUWorker(NNqueueRPC, NNsightGPUWorker):
    def init_device(self) -> None:
        super().init_device()
        stall_watchdog.install(Settings().engine_stall_timeout_s)
        lifetime.exit_with_worker()
