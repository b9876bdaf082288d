"""A shared engine's weights are read-only to traces: a trace's write to a parameter is undone before any other
job's step, and the job that wrote fails saying so.

nnsight hands intervention code the real modules (an envoy's attribute is the module's own ``Parameter``), so
``model.model.norm.weight.zero_()`` in a trace changes the weights every later job of every owner runs on.
PyTorch has no read-only tensor, and a write can come by many roads (an in-place op, ``.data``, a storage,
``param.data = ...``, ``module.weight = Parameter(...)``), so this checks what the weights *are*, not how
they were reached: `WeightsGuard` keeps, per parameter of the engine's module, the ``Parameter`` object its
module holds, its storage (pointer, shape, dtype) and a fingerprint of its content (the sum of its bits read
as integers, exact and deterministic on every device: any write short of one crafted to keep every sum
changes it), plus a copy of its content in host memory (pinned on a GPU; on the CPU engine a second copy in
RAM). `WeightsGuard.check` compares them all and puts back whatever differs: the module's own object, its
storage, its content (``copy_`` from the host copy, so CUDA graphs' pointers stay valid), and returns the
names it restored. Its cost is one read of every parameter (GPU: one reduction per parameter and one
synchronization) each time it runs: 6.5 ms for a Llama-3-8B-shaped model (16 GB of bfloat16 in 195 tensors)
on an H100, about 2.4 TB/s; putting back a 28672x4096 weight took 4.4 ms. The synchronization also means
that the engine's thread waits for a traced step's kernels before it schedules the next step (the overlap
of vLLM's async scheduling is lost for that step): ``benchmarks/harvest_gpu.py --weights-guard off`` gives
the end-to-end difference.

Where it runs (`WeightsGuardWorker`, in both vLLM worker classes): traces' code runs only inside a step
(nnsight's runner unpickles and starts mediators in ``_update_states`` and serves them in
``execute_model``, ``sample_tokens`` and ``_sample``) and in the finish/discard RPCs
(:mod:`nnqueue.enginecore.rpc`: ``tracer.result`` and a block's unwinding run there). So the guard is built
once ``compile_or_warm_up_model`` returns (the weights are loaded, processed and warmed up, graphs captured;
pinning a host copy of 16 GB took 18 s on an H100 host, so it is paid while the engine starts, not by a job),
and checked at the end of every step in which a request carried a trace (a ``sample_tokens`` or, when vLLM
returns from ``execute_model`` alone, that), and after a finish or discard RPC. Steps without a trace (a
harvest's requests run nnqueue's capture code only) pay nothing.

Who fails: a step's writer cannot be told from the other traces in that step (their blocks take turns on one
thread inside one forward), so when a single job's trace ran in the step, that job fails with
``WeightsModified``; when several did, each of them fails with ``WeightsModified`` saying that it may not be
the one. The error rides the request as nnsight's deferred error (``Request.error``, which
``Request.deferred`` reports first), so the job ends FAILED through the ordinary collect path. A write in a
finish RPC is that trace's alone. Other requests in the writer's own step (a harvest chunk's) ran on the
changed weights for that one step and are not failed: the guard bounds the harm to the writer's step.

Under tensor parallelism each rank guards and restores its own shard, and fails the step's requests on its
side; the job's error is the reporting rank's (nnqueue collects from rank 0), so a write that touched only
another rank's shard is put back and logged there, and the job fails only if rank 0's shard changed too. Not covered here: buffers (vLLM itself replaces some lazily, the
rotary cache's dtype, say), module structure and hooks (a trace replacing a submodule or registering a
hook): the protected environment (:mod:`nnqueue.enginecore.protected`) is what keeps those out of reach.

``NNQUEUE_WEIGHTS_GUARD=false`` (``Settings.weights_guard``) turns it off on vLLM engines (a private engine whose
traces may edit the weights for good); the transformers engine always puts the weights back after a job.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the mixin goes before a vLLM worker class in the bases
    from vllm.v1.worker.worker_base import WorkerBase as _Worker
else:
    _Worker = object

log = logging.getLogger(__name__)
GUARD_ENV = "NNQUEUE_WEIGHTS_GUARD"
ERROR_TYPE = "WeightsModified"
_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def enabled() -> bool:
    return os.environ.get(GUARD_ENV, "true").strip().lower() not in ("false", "0", "no", "off")


@dataclass
class _Held:
    module: torch.nn.Module  # the module that owns the parameter
    attribute: str  # its name there
    parameter: torch.nn.Parameter  # the object the module held
    storage: torch.Tensor  # an alias of its original storage (put back if ``.data`` was swapped)
    host: torch.Tensor  # its content, in host memory
    requires_grad: bool


class WeightsGuard:
    """The parameters of ``module`` as they are now; `check` puts them back as they were (see the module doc)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.names: list[str] = []
        self.held: list[_Held] = []
        copies: dict[int, torch.Tensor] = {}  # a tied parameter (held by two modules) has one host copy
        for owner_name, owner in module.named_modules(remove_duplicate=False):
            for attribute, parameter in owner._parameters.items():
                if parameter is None:
                    continue
                self.names.append(f"{owner_name}.{attribute}" if owner_name else attribute)
                storage = parameter.detach()
                if id(parameter) not in copies:
                    copies[id(parameter)] = _host_copy(storage)
                held = _Held(owner, attribute, parameter, storage, copies[id(parameter)], parameter.requires_grad)
                self.held.append(held)
        self.bytes = sum(copy.numel() * copy.element_size() for copy in copies.values())
        self.fingerprint = self._fingerprint()

    def check(self) -> list[str]:
        """The names of the parameters that changed since the guard was built, each put back as it was.

        Gradients a trace left on them (a transformers engine's ``backward()``) are dropped, and their
        ``requires_grad`` set back: neither is a change of the weights, neither may reach the next job."""
        for held in self.held:
            if held.parameter.grad is not None:
                held.parameter.grad = None
            if held.parameter.requires_grad != held.requires_grad:
                held.parameter.requires_grad_(held.requires_grad)
        changed = [index for index, held in enumerate(self.held) if not self._same_object(held)]
        for index in changed:
            self._restore_object(self.held[index])
        now = self._fingerprint()
        if not torch.equal(now, self.fingerprint):  # the one synchronization of a clean check
            differs = (now != self.fingerprint).nonzero().flatten().tolist()
            changed += [index for index in differs if index not in changed]
        with torch.no_grad():
            for index in changed:
                held = self.held[index]
                held.storage.copy_(held.host)
        if changed:
            self._trust_fingerprint()
        return [self.names[index] for index in changed]

    def refresh(self) -> None:
        """The weights were changed on purpose (nnqueue's weights update RPCs): hold them as they are now (the
        module's objects, storages, host copies and fingerprint)."""
        with torch.no_grad():
            for held in self.held:
                current = held.module._parameters[held.attribute]
                assert current is not None
                held.parameter, held.storage = current, current.detach()
                if held.host.shape == held.storage.shape and held.host.dtype == held.storage.dtype:
                    held.host.copy_(held.storage)
                else:
                    held.host = _host_copy(held.storage)
        self.fingerprint = self._fingerprint()

    def _same_object(self, held: _Held) -> bool:
        current = held.module._parameters.get(held.attribute)
        if current is not held.parameter:
            return False
        return bool(
            current.data_ptr() == held.storage.data_ptr()
            and current.shape == held.storage.shape
            and current.dtype == held.storage.dtype
            and current.stride() == held.storage.stride()
        )

    def _restore_object(self, held: _Held) -> None:
        with torch.no_grad():
            held.parameter.data = held.storage
        held.module._parameters[held.attribute] = held.parameter

    def _fingerprint(self) -> torch.Tensor:
        """Each parameter's bits summed as integers (int64, on the parameters' device)."""
        return torch.stack([_bit_sum(held.storage) for held in self.held]).cpu() if self.held else torch.zeros(0)

    def _trust_fingerprint(self) -> None:
        """After a restore: the content is the host copy's again, so is its fingerprint (re-read to be sure)."""
        if not torch.equal(self._fingerprint(), self.fingerprint):
            raise RuntimeError("the weights could not be restored from their host copy")


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits summed as 64-bit words (wrapping: exact, and the same in any order of addition). As
    int64 words where the memory allows (a sum in the words' own type runs about 10x faster on a CPU than one
    that widens each element), else its elements read as integers of their own size."""
    if tensor.is_contiguous() and tensor.numel() and (tensor.numel() * tensor.element_size()) % 8 == 0:
        try:
            return tensor.reshape(-1).view(torch.uint8).view(torch.int64).sum()
        except RuntimeError:  # an offset into its storage that is not 8-byte aligned
            pass
    return tensor.view(_INTEGERS[tensor.element_size()]).sum(dtype=torch.int64)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_cuda:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host


def error(names: list[str], traces: int) -> dict[str, Any]:
    """The deferred error (nnsight's ``DeferredError`` dict) a job whose step changed the weights fails with."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if traces <= 1:
        message = (
            f"this trace changed the model's parameters ({shown}); they were put back before any other job's "
            "step and the job failed: a shared engine's weights are read-only to traces (edit module outputs "
            "instead, or run weight edits on a transformers engine, where an edit lasts for its job)"
        )
    else:
        message = (
            f"a trace in a step this job shared with {traces - 1} other trace(s) changed the model's parameters "
            f"({shown}); they were put back before any later step. Which trace wrote cannot be told, so each "
            "of them failed: if this job does not write to parameters, submit it again"
        )
    return {"type_name": ERROR_TYPE, "message": message, "traceback": "", "is_control_flow": False}


def trace_of(request: Any) -> str:
    """The trace (``<job id>-<attempt>``) of a runner's request: its engine id (nnsight's ``Request.engine_id``,
    the id the frontend gave, without vLLM's suffix or an ``n > 1`` child's prefix) is ``<trace>-<invoke>``."""
    return str(request.engine_id).rsplit("-", 1)[0]


class WeightsGuardWorker(_Worker):
    """Mixin for vLLM worker classes whose runner is nnsight's; see the module doc."""

    model_runner: Any
    _nnqueue_guard: WeightsGuard | None = None
    _nnqueue_guard_off = False
    _nnqueue_traced: tuple[Any, ...] = ()  # this step's requests that carry a trace (nnsight's Request)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        compiled = super().compile_or_warm_up_model(*args, **kwargs)
        self._nnqueue_build_guard()  # the weights are final: loaded, processed, warmed up, graphs captured
        return compiled

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self._nnqueue_guard is None and not self._nnqueue_guard_off:  # an engine that skipped the warm-up
            self._nnqueue_build_guard()
        output = super().execute_model(scheduler_output, *args, **kwargs)
        if self._nnqueue_guard is not None:
            requests = self.model_runner.nnsight_requests.requests
            step = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            self._nnqueue_traced = tuple(
                request
                for request_id in step
                if (request := requests.get(request_id)) is not None and request.mediator is not None
            )
            if output is not None:  # no sample_tokens follows: the step ends here
                self._nnqueue_step_ended()
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        self._nnqueue_step_ended()
        return output

    def nnqueue_check_weights(self) -> list[str]:
        """Put back any parameter a trace changed outside a step (the finish and discard RPCs); the names."""
        if self._nnqueue_guard is None:
            return []
        changed = self._nnqueue_guard.check()
        if changed:
            log.error("a trace changed parameters %s while it was finished; they were put back", changed[:20])
        return changed

    def nnqueue_weights_loaded(self) -> None:
        """After a legitimate weights update (nnqueue's RPC, never a trace): the guard holds the new weights."""
        if self._nnqueue_guard is not None:
            self._nnqueue_guard.refresh()

    def nnqueue_restore_weights(self) -> bool:
        """Put back the weights the guard holds (a weights update that failed midway); False without a guard."""
        if self._nnqueue_guard is None:
            return False
        restored = self._nnqueue_guard.check()
        log.warning("weights update rolled back: %d parameters put back", len(restored))
        return True

    def _nnqueue_build_guard(self) -> None:
        if self._nnqueue_guard is not None:
            return
        if not enabled():
            self._nnqueue_guard_off = True
            return
        self._nnqueue_guard = WeightsGuard(self.model_runner.get_model())
        log.info(
            "weights guard: %d parameters, %.1f MiB host copy",
            len(self._nnqueue_guard.held),
            self._nnqueue_guard.bytes / 2**20,
        )

    def _nnqueue_step_ended(self) -> None:
        traced, self._nnqueue_traced = self._nnqueue_traced, ()
        if not traced or self._nnqueue_guard is None:
            return
        changed = self._nnqueue_guard.check()
        if changed:
            fail_traces(traced, changed)


def fail_traces(requests: Iterable[Any], changed: list[str]) -> None:
    """Give each request (nnsight's ``Request``) that carried a trace in a step that changed ``changed`` its error."""
    requests = list(requests)
    traces = {trace_of(request) for request in requests}
    log.error("a step with %d trace(s) %s changed parameters %s; put back", len(traces), sorted(traces), changed[:20])
    deferred = error(changed, len(traces))
    for request in requests:
        if request.error is None:
            request.error = dict(deferred)
