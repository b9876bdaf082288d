"""nnsight's CUDA worker, sandboxed (:mod:`nnqueue.enginecore.sandbox`), with nnqueue's stall watchdog and RPC methods."""

from __future__ import annotations

from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from nnqueue.enginecore import lifetime, stall_watchdog
from nnqueue.enginecore.crash_report import CrashReportingWorker
from nnqueue.enginecore.rpc import NNqueueRPC
from nnqueue.enginecore.sandbox import EngineConfig, SandboxedWorker


class NNqueueGPUWorker(SandboxedWorker, CrashReportingWorker, NNqueueRPC, NNsightGPUWorker):
    def init_device(self) -> None:
        super().init_device()
        stall_watchdog.install(EngineConfig.from_environment().stall_timeout_s)
        lifetime.exit_with_worker()
