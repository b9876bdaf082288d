"""nnsight's CUDA worker, plus nnqueue's stall watchdog (see :mod:`nnqueue.enginecore.stall_watchdog`),
harvest capture (:mod:`nnqueue.enginecore.harvest_capture`) and RPC methods (:mod:`nnqueue.enginecore.rpc`)."""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from nnqueue.enginecore import lifetime, stall_watchdog
from nnqueue.enginecore.harvest_capture import HarvestRunnerMixin
from nnqueue.enginecore.rpc import NNqueueRPC
from nnqueue.settings import Settings


class NNqueueGPUModelRunner(HarvestRunnerMixin, NNsightGPUModelRunner):
    """nnqueue's harvest capture over nnsight's runner; adds no constructor state (re-classed in place)."""


class NNqueueGPUWorker(NNqueueRPC, NNsightGPUWorker):
    def init_device(self) -> None:
        super().init_device()  # checks the runner is vLLM's V1 GPUModelRunner, re-classes it to nnsight's
        self.model_runner.__class__ = NNqueueGPUModelRunner
        stall_watchdog.install(Settings().engine_stall_timeout_s)
        lifetime.exit_with_worker()
