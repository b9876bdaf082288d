"""A shared engine's weights are read-only to traces: a trace's write to a parameter is undone before any other
job's step, and the job that wrote fails saying so.

nnsight hands intervention code the real modules (an envoy's attribute is the module's own ``Parameter``), so
``model.model.norm.weight.zero_()`` in a trace changes the weights every later job of every owner runs on.
PyTorch has no read-only tensor, and a write can come by many roads (an in-place op, ``.data``, a storage,
``param.data = ...``, ``module.weight = Parameter(...)``). `WeightsGuard` keeps, per parameter of the engine's
module, the ``Parameter`` object its module holds, its storage (pointer, shape, dtype, strides), its version
counter, a fingerprint of its content (the sum of its bits read as integers, exact and deterministic on every
device) and a copy of its content in host memory (pinned on a GPU; on the CPU engine a second copy in RAM).

What each check reads, and what it catches (`WeightsGuard.check`):

* **Every traced step: objects and version counters, no device work.** PyTorch's version counter
  (``Tensor._version``, torch's ``c10::VariableVersion``) is shared by a tensor, its views (autograd's view
  tracking, inside ``torch.inference_mode`` too) and ``detach()``, and bumped by every in-place op, ``out=`` and
  ``copy_``: ``weight.zero_()``, ``weight[0] = 1``, ``weight.view(-1).add_(1)``, ``torch.nn.init.*``,
  ``load_state_dict``. Swapping ``.data``, ``set_`` on the parameter, ``share_memory_``, ``swap_tensors``
  and replacing the module's parameter change the object or its storage pointer. Reading these is a few
  attribute reads per parameter on the engine's thread (about 0.1 ms for 195 parameters): no read of the
  weights and no device synchronization, so vLLM's async scheduling keeps its overlap. Only a parameter whose
  counter moved is compared with its host copy, element by element (exact, so a write that keeps every sum
  is caught too): changed values fail the step's traces; a write that kept every value (vLLM's own, say)
  fails nobody and its count becomes the reference.
* **A full content check where a road bypasses the version counter.** Some aliases of a tensor's memory get a
  counter of their own: ``.data``, its storage (``untyped_storage()``, ``storage()``, ``set_(storage)`` on
  another tensor, ``new(storage)``), ``set_(weight)`` on another tensor, ``numpy()``/``__array__`` and DLPack
  (``from_dlpack``, ``frombuffer``), ``unsafe_split``/``unsafe_chunk``, and, inside ``torch.inference_mode``
  (where traces run), a ``view(dtype)``. Python cannot close these roads (a tensor's class is shared with
  the model's own code, which uses ``weight.data`` in its forward), so the protected environment notes
  them instead (:data:`nnqueue.enginecore.protected.ROAD_NAMES`): a trace whose code (its blocks and the
  functions it sent) names one of them, or that reaches one through ``getattr``/``setattr``/``__import__``,
  is marked (`nnqueue.enginecore.protected.opens_roads`), and a step or finish in which a marked trace runs
  gets the full check: every parameter's fingerprint (one read of the weights: 6.5 ms for a
  Llama-3-8B-shaped model, 16 GB of bfloat16 in 195 tensors, on an H100) and one synchronization, as
  every traced step paid before. Parameters whose tensor keeps no version counter (an inference tensor) are
  fingerprinted at every check.
* **A periodic full check** (every :data:`FULL_CHECK_INTERVAL_S` of traced steps) for what the two above miss:
  an alias a marked trace made and left where a later, unmarked trace writes through it (the protected
  environment has shared objects a trace can leave things on). That write is put back at the next periodic
  check, failing the traces of that step (the message says the writer is unknown); the jobs in between ran
  on the changed weights.

What changed is put back: the module's own object, its storage, its content (``copy_`` from the host copy, so
CUDA graphs' pointers stay valid; 4.4 ms for a 28672x4096 weight on an H100), and the check returns the names it
restored. A legitimate update of the weights (a new checkpoint loaded into the engine) must call
`WeightsGuard.accept_current` (the worker's ``nnqueue_accept_weights``) afterwards, or the next check would put
the old weights back.

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
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nnqueue.enginecore import kv_clearing, protected, state_guard

if TYPE_CHECKING:  # the mixin goes before a vLLM worker class in the bases
    from vllm.v1.worker.worker_base import WorkerBase as _Worker
else:
    _Worker = object

log = logging.getLogger(__name__)
GUARD_ENV = "NNQUEUE_WEIGHTS_GUARD"
ERROR_TYPE = "WeightsModified"  # a trace changed parameters (alone in its step, or in its finish)
STATE_ERROR_TYPE = "StateModified"  # a trace changed other tensors, attributes, hooks or the engine's code
SHARED_STEP_ERROR = "StateModifiedInSharedStep"  # a change in a step of several traces: each runs again alone
_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# How often (seconds, counted at traced steps) the weights are read in full whatever the traces named.
FULL_CHECK_INTERVAL_S = 30.0


def enabled() -> bool:
    return os.environ.get(GUARD_ENV, "true").strip().lower() not in ("false", "0", "no", "off")


@dataclass
class _Held:
    module: torch.nn.Module  # the module that owns the parameter
    table: str  # where the module holds it: "_parameters", "_buffers" or "__dict__" (a tensor attribute)
    attribute: str  # its name there
    parameter: torch.Tensor  # the object the module held (a Parameter, for a parameter)
    storage: torch.Tensor  # an alias of its original storage (put back if ``.data`` was swapped); shares its counter
    host: torch.Tensor  # its content, in host memory
    requires_grad: bool
    pointer: int  # its storage's data_ptr()
    version: int | None  # the storage's version counter when last seen; None: an inference tensor (none kept)


# Where a module holds the tensors the guard keeps, and what the name says of each kind but parameters.
TABLES = (("_parameters", ""), ("_buffers", " (buffer)"), ("__dict__", " (attribute)"))


def _tensors(owner: torch.nn.Module, skipped: set[int]) -> list[tuple[str, str, str, torch.Tensor]]:
    """``(table, attribute, suffix, tensor)`` for the tensors ``owner`` holds: its parameters, its buffers, and
    tensors held as plain attributes (an attention layer's scales) but those whose memory is in ``skipped`` (the
    KV cache, which every step writes)."""
    found = []
    for table, suffix in TABLES:
        for attribute, tensor in getattr(owner, table).items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if table == "__dict__" and _storage_pointer(tensor) in skipped:
                continue
            found.append((table, attribute, suffix, tensor))
    return found


def _storage_pointer(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except RuntimeError:  # a tensor without storage (meta, a wrapper subclass)
        return 0


class WeightsGuard:
    """The tensors of ``module`` as they are now; `check` puts them back as they were (see the module doc).

    Its parameters, buffers (``rotary_emb.cos_sin_cache``) and tensors held as plain attributes; ``skipped``: the
    storage addresses of tensors never kept (the KV cache)."""

    def __init__(self, module: torch.nn.Module, skipped: Iterable[int] = ()) -> None:
        self.module = module
        self.skipped = set(skipped) - {0}
        self.names: list[str] = []
        self.held: list[_Held] = []
        self.bytes = 0
        self.fingerprint = torch.zeros(0)
        self.accept_current()

    def accept_current(self) -> None:
        """Take the module's parameters as they are now for the reference: call it after a legitimate update of the
        weights (a checkpoint loaded in place, or parameters replaced), which the next check would otherwise undo.
        It copies every parameter to host memory again (seconds for billions of parameters)."""
        previous = {name: held.host for name, held in zip(self.names, self.held, strict=True)}
        self.names, self.held = [], []
        copies: dict[int, torch.Tensor] = {}  # a tied parameter (held by two modules) has one host copy
        self.parameters: set[str] = set()
        for owner_name, owner in self.module.named_modules(remove_duplicate=False):
            for table, attribute, suffix, parameter in _tensors(owner, self.skipped):
                name = (f"{owner_name}.{attribute}" if owner_name else attribute) + suffix
                self.names.append(name)
                if table == "_parameters":
                    self.parameters.add(name)
                storage = parameter.detach()
                if id(parameter) not in copies:
                    copies[id(parameter)] = _host_copy(storage, reuse=previous.get(name))
                held = _Held(
                    owner,
                    table,
                    attribute,
                    parameter,
                    storage,
                    copies[id(parameter)],
                    parameter.requires_grad,
                    storage.data_ptr(),
                    _version(storage),
                )
                self.held.append(held)
        self.bytes = sum(copy.numel() * copy.element_size() for copy in copies.values())
        self.fingerprint = self._fingerprint(range(len(self.held)))
        self.uncounted = [index for index, held in enumerate(self.held) if held.version is None]

    def check(self, content: bool = True) -> list[str]:
        """The names of the parameters that changed since the reference was taken, each put back as it was.

        Always: the objects, storages and version counters (no device work). ``content``: also every
        parameter's fingerprint (one read of the weights and a synchronization); without it, only those of
        parameters that keep no version counter. Gradients a trace left on them (a transformers engine's
        ``backward()``) are dropped, and their ``requires_grad`` set back: neither is a change of the weights,
        neither may reach the next job."""
        changed: list[int] = []
        bumped: list[int] = []
        for index, held in enumerate(self.held):
            parameter = held.parameter
            if parameter.grad is not None:
                parameter.grad = None
            if parameter.requires_grad != held.requires_grad:
                parameter.requires_grad_(held.requires_grad)
            current = getattr(held.module, held.table).get(held.attribute)
            # The pointer alone without ``content``: a same-pointer change of shape, strides or dtype is an
            # in-place op (which bumps the counter) or a ``.data`` swap (a road, which asks for ``content``).
            if current is not parameter or current.data_ptr() != held.pointer or (content and not self._same(held)):
                self._restore_object(held)
                changed.append(index)
            elif held.version is not None and held.storage._version != held.version:
                bumped.append(index)
        read = range(len(self.held)) if content else self.uncounted
        if read:
            now = self._fingerprint(read)
            if not torch.equal(now, self.fingerprint[list(read)]):  # the synchronization of a content check
                differs = (now != self.fingerprint[list(read)]).nonzero().flatten().tolist()
                changed += [read[index] for index in differs if read[index] not in changed]
        for index in bumped:  # written: changed unless every element is as it was (vLLM's own writes, say)
            if index not in changed and not torch.equal(self.held[index].storage, self._host_on_device(index)):
                changed.append(index)
            else:
                self.held[index].version = _version(self.held[index].storage)
        if not changed:
            return []
        with torch.no_grad():
            for index in changed:
                held = self.held[index]
                held.storage.copy_(held.host)
        for index in changed:  # copy_ bumped them
            self.held[index].version = _version(self.held[index].storage)
        self._trust_fingerprint(changed)
        return [self.names[index] for index in sorted(changed)]

    def _host_on_device(self, index: int) -> torch.Tensor:
        held = self.held[index]
        return held.host.to(held.storage.device)

    @staticmethod
    def _same(held: _Held) -> bool:
        """Whether the parameter's shape, strides and dtype are its storage alias's (its pointer is)."""
        current = held.parameter
        return bool(
            current.shape == held.storage.shape
            and current.dtype == held.storage.dtype
            and current.stride() == held.storage.stride()
        )

    def _restore_object(self, held: _Held) -> None:
        if held.parameter.data_ptr() != held.pointer or not self._same(held):
            with torch.no_grad():
                held.parameter.data = held.storage
        getattr(held.module, held.table)[held.attribute] = held.parameter

    def _fingerprint(self, indices: Sequence[int]) -> torch.Tensor:
        """The bits of the parameters at ``indices`` summed as integers (int64, on the CPU: a synchronization)."""
        if not indices:
            return torch.zeros(0, dtype=torch.int64)
        sums = [_bit_sum(self.held[index].storage) for index in indices]
        by_device: dict[torch.device, list[int]] = {}
        for position, value in enumerate(sums):  # a GPU model keeps some buffers on the CPU
            by_device.setdefault(value.device, []).append(position)
        if len(by_device) == 1:
            return torch.stack(sums).cpu()
        found = torch.empty(len(sums), dtype=torch.int64)
        for positions in by_device.values():  # one synchronization per device
            found[positions] = torch.stack([sums[position] for position in positions]).cpu()
        return found

    def _trust_fingerprint(self, indices: list[int]) -> None:
        """After a restore: the content is the host copy's again, so is its fingerprint (re-read to be sure)."""
        if not torch.equal(self._fingerprint(indices), self.fingerprint[indices]):
            raise RuntimeError("the weights could not be restored from their host copy")


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, or None for an inference tensor (which keeps none)."""
    return None if tensor.is_inference() else int(tensor._version)


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


def _host_copy(tensor: torch.Tensor, reuse: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned on a GPU), written into ``reuse`` where it has the same shape and dtype: a
    weights update then costs a copy, not a new pinned allocation (18 s for 16 GB on an H100 host)."""
    if reuse is not None and reuse.shape == tensor.shape and reuse.dtype == tensor.dtype:
        reuse.copy_(tensor)
        return reuse
    if not tensor.is_cuda:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host


@dataclass
class Verified:
    """What a verification found and put back: parameters (``weights``), other tensors and strict state
    (``state``), and lazy state (``lazy``: possibly the engine's own work a trace triggered)."""

    weights: list[str] = field(default_factory=list)
    state: list[str] = field(default_factory=list)
    lazy: list[str] = field(default_factory=list)

    @property
    def blames(self) -> bool:
        """Whether a trace alone in the step (or a finish) that changed this fails for it."""
        return bool(self.weights or self.state)

    def __bool__(self) -> bool:
        return bool(self.weights or self.state or self.lazy)


def error(weights: list[str], state: list[str]) -> dict[str, Any]:
    """The deferred error (nnsight's ``DeferredError`` dict) a trace fails with when it changed the engine's
    parameters (``WeightsModified``) or other state (``StateModified``), alone in its step or in its finish."""
    if weights:
        message = (
            f"this trace changed the model's parameters ({state_guard.describe(weights + state)}); they were put "
            "back before any other job's step and the job failed: a shared engine's weights are read-only to "
            "traces (edit module outputs instead, or run weight edits on a transformers engine, where an edit "
            "lasts for its job)"
        )
    else:
        message = (
            f"this trace changed the engine's state ({state_guard.describe(state)}); it was put back before any "
            "other job's step and the job failed: a shared engine's modules, their attributes and hooks, and the "
            "engine's code are read-only to traces (edit module outputs, or use .skip() and .source, instead)"
        )
    return {
        "type_name": ERROR_TYPE if weights else STATE_ERROR_TYPE,
        "message": message,
        "traceback": "",
        "is_control_flow": False,
    }


def shared_error(verified: Verified, traces: int) -> dict[str, Any]:
    """The deferred error of each trace in a step shared by ``traces`` traces that changed what ``verified`` names:
    the worker runs each of them again alone (``SHARED_STEP_ERROR``), so that only the one that changes it again
    is failed for it."""
    names = state_guard.describe(verified.weights + verified.state + verified.lazy)
    return {
        "type_name": SHARED_STEP_ERROR,
        "message": (
            f"a trace in a step this job shared with {traces - 1} other trace(s) changed the engine's state "
            f"({names}); it was put back before any later step. Which trace did it cannot be told, so each of them "
            "runs again alone"
        ),
        "traceback": "",
        "is_control_flow": False,
    }


def trace_of(request: Any) -> str:
    """The trace (``<job id>-<attempt>``) of a runner's request: its engine id (nnsight's ``Request.engine_id``,
    the id the frontend gave, without vLLM's suffix or an ``n > 1`` child's prefix) is ``<trace>-<invoke>``."""
    return str(request.engine_id).rsplit("-", 1)[0]


@dataclass(frozen=True)
class Due:
    """What the check after finishing (or discarding) a trace reads: the weights in full (``content``), and the
    rest of the state when the trace's code ran there (``ran``: a mediator still alive had its block resumed)."""

    content: bool
    ran: bool


class WeightsGuardWorker(_Worker):
    """Mixin for vLLM worker classes whose runner is nnsight's; see the module doc (and
    :mod:`nnqueue.enginecore.state_guard` for the state beyond the tensors)."""

    model_runner: Any
    _nnqueue_guard: WeightsGuard | None = None
    _nnqueue_state: state_guard.StateGuard | None = None
    _nnqueue_guard_off = False
    _nnqueue_traced: tuple[Any, ...] = ()  # this step's requests that carry a trace (nnsight's Request)
    _nnqueue_full_check_at = 0.0  # time.monotonic() of the next periodic full check
    _nnqueue_trace_ids: set[str]  # the runner's requests that carry a trace (kv_clearing), set with the guard

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        compiled = super().compile_or_warm_up_model(*args, **kwargs)
        self._nnqueue_build_guard()  # the weights are final: loaded, processed, warmed up, graphs captured
        return compiled

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self._nnqueue_guard is None and not self._nnqueue_guard_off:  # an engine that skipped the warm-up
            self._nnqueue_build_guard()
        if self._nnqueue_state is None and self._nnqueue_guard is not None:
            # The state is taken at the first step, before any payload loads: vLLM finishes its configuration
            # (the KV cache's size) after the warm-up, and the sandbox locks the process down at this step.
            # The engine's objects every request reaches by persistent id keep their shape: the interleaver and
            # what it holds, and the tokenizer (a third red-team round left a function on it that ran in every later
            # step of every domain, and kept a view of vLLM's input buffer there that read another's prompt).
            nnsight_model = self.model_runner.nnsight_model
            interleaver, tokenizer = nnsight_model.interleaver, getattr(nnsight_model, "tokenizer", None)
            shared = (interleaver, interleaver.batcher, interleaver.fragments)
            self._nnqueue_state = state_guard.StateGuard(
                self.model_runner.get_model(),
                roots=(self, self.model_runner),
                shaped=shared if tokenizer is None else (*shared, tokenizer),
            )
            log.info("state guard: %d containers", len(self._nnqueue_state.containers))
            # A step run again without its failed traces (nnqueue.enginecore.step_recovery) runs on this state.
            self.model_runner.nnqueue_restore_state = lambda: self._nnqueue_verify(True)
        output = super().execute_model(scheduler_output, *args, **kwargs)
        if self._nnqueue_guard is not None:
            requests = self.model_runner.nnsight_requests.requests
            step = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            traced = {
                request_id: request
                for request_id in step
                if (request := requests.get(request_id)) is not None and request.mediator is not None
            }
            self._nnqueue_traced = tuple(traced.values())
            # Finished requests leave the runner at the step after they finish: those ids leave this set with them.
            self._nnqueue_trace_ids.difference_update(getattr(scheduler_output, "finished_req_ids", None) or ())
            self._nnqueue_trace_ids.update(traced)
            if output is not None:  # no sample_tokens follows: the step ends here
                self._nnqueue_step_ended()
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        self._nnqueue_step_ended()
        return output

    def nnqueue_check_due(self, request_ids: Iterable[str]) -> Due:
        """What the check after finishing (or discarding) the trace whose invokes are ``request_ids`` reads (see
        `Due`); ask before the requests are released."""
        if self._nnqueue_guard is None:
            return Due(False, False)
        wanted = set(request_ids)
        requests = [
            request for request in self.model_runner.nnsight_requests.requests.values() if request.named(wanted)
        ]
        mediators = [request.mediator for request in requests if request.mediator is not None]
        return Due(self._nnqueue_content_due(mediators), any(mediator.alive for mediator in mediators))

    def nnqueue_check_after(self, due: Due) -> Verified:
        """Put back what a trace changed outside a step (the finish and discard RPCs, where only its code runs);
        lazy changes are put back and not blamed (the trace is alone)."""
        if self._nnqueue_guard is None:
            return Verified()
        verified = self._nnqueue_verify(due.content, state=due.ran)
        if verified.blames:
            log.error("a trace changed %s while it was finished; put back", (verified.weights + verified.state)[:20])
        return Verified(verified.weights, verified.state)

    def nnqueue_verify_state(self, seed: int | None = None) -> dict[str, list[str]]:
        """Verify and restore everything the guards hold, reading every tensor in full (what a trust-domain switch
        calls, with nothing in flight): ``{"weights": [...], "state": [...], "lazy": [...]}``, the names put back.
        ``seed``: torch's generators are then seeded with it (the switch's fresh seed, the same on every rank:
        `StateGuard.reseed`). Then the KV cache's blocks that no harvest or steering request holds are zeroed
        (:mod:`nnqueue.enginecore.kv_clearing`): ``"zeroed": ["<blocks> of <all>"]`` (``None of ...`` with prefix
        caching). An engine without guards (``NNQUEUE_WEIGHTS_GUARD=false``) answers with ``"off": ["guards"]``."""
        if self._nnqueue_guard is None:
            return {"weights": [], "state": [], "lazy": [], "off": ["guards"]}
        verified = self._nnqueue_verify(True, state=True)
        if seed is not None and self._nnqueue_state is not None:
            self._nnqueue_state.reseed(seed)
        runner = self.model_runner
        cleared = kv_clearing.clear_free_blocks(
            runner, self._nnqueue_trace_ids, bool(self.vllm_config.cache_config.enable_prefix_caching)
        )
        if verified:
            log.error("verification put back %s", (verified.weights + verified.state + verified.lazy)[:20])
        zeroed = f"{cleared} of {runner.kv_cache_config.num_blocks}"  # the worker logs it: a record of its own
        return {"weights": verified.weights, "state": verified.state, "lazy": verified.lazy, "zeroed": [zeroed]}

    def nnqueue_weights_loaded(self) -> None:
        """After a legitimate weights update (nnqueue's RPC, never a trace): the guards take the weights and state as
        they are now for their reference (`WeightsGuard.accept_current`)."""
        if self._nnqueue_guard is not None:
            self._nnqueue_guard.accept_current()
            self._nnqueue_full_check_at = time.monotonic() + FULL_CHECK_INTERVAL_S
        if self._nnqueue_state is not None:
            self._nnqueue_state.accept_current()

    def nnqueue_accept_hooks(self) -> None:
        """nnqueue installed hooks of its own (a harvest's captures, a steering job's edits, in their begin RPCs):
        the state guard takes the modules' hook tables as they are now."""
        if self._nnqueue_state is not None:
            self._nnqueue_state.accept_hooks()

    def nnqueue_restore_weights(self) -> bool:
        """Put back the weights the guard holds (a weights update that failed midway), and the model's state the
        state guard holds (vLLM's in-place reload sets attributes of its own on the model); False without a
        weights guard. Left to the next trace's check, the state was blamed on that trace (``StateModified``)."""
        if self._nnqueue_guard is None:
            return False
        restored = self._nnqueue_guard.check()
        changed = self._nnqueue_state.check() if self._nnqueue_state is not None else None
        log.warning(
            "weights update rolled back: %d parameters put back%s",
            len(restored),
            f", and the model's state ({', '.join(changed.strict + changed.lazy)})" if changed else "",
        )
        return True

    def _nnqueue_build_guard(self) -> None:
        if self._nnqueue_guard is not None:
            return
        if not enabled():
            self._nnqueue_guard_off = True
            return
        self._nnqueue_trace_ids = set()
        model = self.model_runner.get_model()
        kv_caches = getattr(self.model_runner, "kv_caches", None) or []
        self._nnqueue_guard = WeightsGuard(model, skipped=map(_storage_pointer, kv_caches))
        self._nnqueue_full_check_at = time.monotonic() + FULL_CHECK_INTERVAL_S
        log.info(
            "weights guard: %d tensors (%d without a version counter, read at every check), %.1f MiB host copy",
            len(self._nnqueue_guard.held),
            len(self._nnqueue_guard.uncounted),
            self._nnqueue_guard.bytes / 2**20,
        )

    def _nnqueue_verify(self, content: bool, state: bool = True) -> Verified:
        """Check (and put back) the rest of the state when ``state``, then the tensors (see the module doc). The
        state first: it holds the guards' own code (a trace that replaced ``WeightsGuard.check`` and zeroed a
        weight gets both put back), and both checks are called as they were when this module was loaded."""
        assert self._nnqueue_guard is not None
        verified = Verified()
        if state and self._nnqueue_state is not None:
            changes = _CHECK_STATE(self._nnqueue_state)
            verified.state += changes.strict
            verified.lazy += changes.lazy
        tensors = _CHECK_TENSORS(self._nnqueue_guard, content)
        verified.weights = [name for name in tensors if name in self._nnqueue_guard.parameters]
        verified.state = [name for name in tensors if name not in self._nnqueue_guard.parameters] + verified.state
        return verified

    def _nnqueue_step_ended(self) -> None:
        traced, self._nnqueue_traced = self._nnqueue_traced, ()
        if not traced or self._nnqueue_guard is None:
            return
        content = self._nnqueue_content_due([request.mediator for request in traced])
        verified = self._nnqueue_verify(content)
        if verified:
            fail_step(traced, verified)

    def _nnqueue_content_due(self, mediators: Iterable[Any]) -> bool:
        """Whether this check reads the weights: a trace that opens a road past the version counter ran
        (`protected.opens_roads`, or one reached at run time), or the periodic full check is due."""
        reached = protected.take_roads_reached()  # taken whatever the mediators say: it is for this check
        if reached or not protected.installed() or any(map(protected.opens_roads, mediators)):
            return True
        if time.monotonic() >= self._nnqueue_full_check_at:
            self._nnqueue_full_check_at = time.monotonic() + FULL_CHECK_INTERVAL_S
            return True
        return False


# The guards' checks as this module found them: the worker calls these, not what the classes hold at the time.
_CHECK_STATE = state_guard.StateGuard.check
_CHECK_TENSORS = WeightsGuard.check


def fail_step(requests: Iterable[Any], verified: Verified) -> None:
    """Give the requests (nnsight's ``Request``) that carried a trace in a step whose check found ``verified``
    their error: a trace alone in the step fails for a change it is blamed for (`error`) and not for a lazy one;
    traces that shared the step each run again alone (`shared_error`)."""
    requests = list(requests)
    traces = {trace_of(request) for request in requests}
    names = (verified.weights + verified.state + verified.lazy)[:20]
    log.error("a step with %d trace(s) %s changed %s; put back", len(traces), sorted(traces), names)
    if len(traces) == 1 and not verified.blames:
        return
    deferred = error(verified.weights, verified.state) if len(traces) == 1 else shared_error(verified, len(traces))
    for request in requests:
        if request.error is None:
            request.error = dict(deferred)
