"""nnsight's CUDA worker, sandboxed (:mod:`nnqueue.enginecore.sandbox`), with nnqueue's stall watchdog
(:mod:`nnqueue.enginecore.stall_watchdog`), crash reports, weights guard (:mod:`nnqueue.enginecore.weights_guard`), harvest capture (:mod:`nnqueue.enginecore.harvest_capture`)
and RPC methods (:mod:`nnqueue.enginecore.rpc`)."""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from nnqueue.enginecore import lifetime, stall_watchdog
from nnqueue.enginecore.crash_report import CrashReportingWorker
from nnqueue.enginecore.envoy_trees import EnvoyTreesMixin
from nnqueue.enginecore.harvest_capture import HarvestRunnerMixin
from nnqueue.enginecore.pipeline_stages import PipelineStageMixin
from nnqueue.enginecore.rpc import NNqueueRPC
from nnqueue.enginecore.sandbox import EngineConfig, SandboxedWorker
from nnqueue.enginecore.steering import SteerRunnerMixin
from nnqueue.enginecore.step_recovery import SampleCheckMixin, StepRecoveryMixin
from nnqueue.enginecore.weights_guard import WeightsGuardWorker


class _RecoveringGPUModelRunner(StepRecoveryMixin, GPUModelRunner):  # type: ignore[misc]  # vLLM types the mixin's hooks narrowly
    """vLLM's runner under nnsight's, with the step recovery between them (:mod:`nnqueue.enginecore.step_recovery`)."""


class NNqueueGPUModelRunner(  # type: ignore[misc]
    EnvoyTreesMixin,
    SteerRunnerMixin,
    HarvestRunnerMixin,
    PipelineStageMixin,
    SampleCheckMixin,
    NNsightGPUModelRunner,
    _RecoveringGPUModelRunner,
):
    """nnqueue's harvest capture, steering and requests' envoy trees over nnsight's runner, a malformed
    intervention's step run again without it; adds no constructor state (re-classed in place)."""


class NNqueueGPUWorker(SandboxedWorker, CrashReportingWorker, WeightsGuardWorker, NNqueueRPC, NNsightGPUWorker):
    def init_device(self) -> None:
        super().init_device()  # checks the runner is vLLM's V1 GPUModelRunner, re-classes it to nnsight's
        self.model_runner.__class__ = NNqueueGPUModelRunner
        stall_timeout_s = EngineConfig.from_environment().stall_timeout_s
        stall_watchdog.install(stall_timeout_s, stall_watchdog.request_id_in(lambda: self.model_runner))
        lifetime.exit_with_worker()
