"""The engine processes' side of isolation: the protected environment, the drop to the engine user, seccomp.

Mixed into both engine worker classes (``cpu_worker``, ``gpu_worker``), first in their bases:

* ``init_device``: the protected environment (:mod:`nnqueue.enginecore.protected`) is installed before
  any payload can arrive (it refuses what intervention code may not do while it runs);
* ``compile_or_warm_up_model``, in an engine process that an nnqueue worker started
  (:func:`nnqueue.isolation.started_by_worker`; an engine a library user builds in or under their own
  process is never switched) with the seccomp filter on: the process builds the sampler's lazily compiled kernels
  (:func:`warm_up_jit`: a C compiler run, which the filter forbids later) as the last part of the engine's start,
  not of its first job's step;
* the first ``execute_model``, in such a process: it switches to the engine user the worker chose at start-up
  (:func:`nnqueue.isolation.drop_privileges`; the worker exports an empty user when its probe found the
  user cannot use this Python, and the process then keeps root, without capabilities in this thread), and
  applies the seccomp filter (:mod:`nnqueue.seccomp_filter`).
  Users' code arrives only with requests (nnsight's runner
  unpickles a request's mediator inside ``execute_model``), and by then the engine is entirely up: model
  loaded, KV cache allocated, graphs compiled and captured, and the ZMQ sockets to the frontend connected.
  Earlier is too early: vLLM's engine core connects its input and output sockets (``ipc://`` files the
  root frontend created) only after ``compile_or_warm_up_model`` returns (vLLM 0.32 and 0.24). The one file
  the process still opens afterwards, the ``file://`` rendezvous of torch.distributed's ``FileStore``
  (CPU platform), is handed to the engine user first. Then the protected environment's lock-down starts
  (``protected.lock_down``): from there on no thread of the process may start a program, load a native library
  through ctypes or open a non-unix socket (the compilers torch and Triton run for a new shape excepted).

Settings come from the environment only (:class:`EngineConfig`): ``.env`` is never read here.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the mixin goes before a vLLM worker class in the bases
    from vllm.v1.worker.worker_base import WorkerBase as _Worker
else:
    _Worker = object

from nnqueue import isolation, logs, seccomp_filter
from nnqueue.enginecore import protected

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """The settings engine processes use, from the variables the worker exports for them
    (``Settings.engine_environment``). Read from the environment alone: never ``.env``, and without the
    worker's own settings, whose rules between values the engine has no part in."""

    stall_timeout_s: float = 60.0
    protected_environment: bool = True
    allowed_modules: tuple[str, ...] = ()
    seccomp: bool = True

    @classmethod
    def from_environment(cls) -> EngineConfig:
        env = os.environ
        return cls(
            stall_timeout_s=float(env.get("NNQUEUE_ENGINE_STALL_TIMEOUT_S", cls.stall_timeout_s)),
            protected_environment=_flag(env.get("NNQUEUE_PROTECTED_ENVIRONMENT", "true")),
            allowed_modules=tuple(
                name.strip() for name in env.get("NNQUEUE_ALLOWED_MODULES", "").split(",") if name.strip()
            ),
            seccomp=_flag(env.get("NNQUEUE_ENGINE_SECCOMP", "true")),
        )


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("false", "0", "no", "off")


# What a job in a child process (a trace builder, the transformers engine) imports: imported before the drop,
# since the engine user may not read this interpreter's files (a Python in root's home).
JOB_MODULES = (
    "nnsight.intervention.errors",
    "nnsight.schema.request",
    "nnsight.tracing.tracer",
    "nnsight.tracing.util",
    "nnqueue.enginecore.trace_results",
    "nnqueue.storage.results",
    "safetensors.torch",
)
# What the worker's start-up probe imports as the engine user (nnqueue.isolation.plan_containment): what the
# engine and builder processes import after the switch. Modules users' code may import (the protected
# environment's allow-list), what jobs load, the standard library's lazily imported modules (nnsight's source
# parsing, inductor's ``symtable``) and inductor's compiler cache (which also reads Python's headers).
PROBE_MODULES = (
    *sorted(protected.ALLOWED_MODULES - {"__future__"}),
    *JOB_MODULES,
    "symtable",
    "ast",
    "inspect",
    "linecache",
    "tokenize",
    "torch._inductor.codecache",
    "nnqueue.enginecore.sandbox",
)


def enter_child_sandbox() -> EngineConfig:
    """What a child process that runs users' code (a trace builder, the transformers engine) does once its model
    is loaded and before the first payload: import what jobs use, scrub the secrets and, when root, drop to the
    engine user the worker chose, apply the seccomp filter, then install the protected environment. Returns the
    engine's settings."""
    for name in JOB_MODULES:
        importlib.import_module(name)
    isolation.enter_sandbox()
    config = EngineConfig.from_environment()
    if config.seccomp and isolation.started_by_worker():
        seccomp_filter.install(isolation.engine_needs_network())
    if config.protected_environment:
        protected.install(config.allowed_modules)
        protected.lock_down()
    return config


def warm_up_jit(vocab_size: int, device: Any) -> None:
    """Build the sampler kernel vLLM compiles on first use (``torch.compile`` with inductor: a C compiler run)
    while this process may still exec: logprobs' ``batched_count_greater_than`` (vLLM 0.32,
    ``vllm.v1.sample.ops.logprobs``), through the call vLLM itself makes (``Sampler.gather_logprobs``: the
    batch dimension unbacked, so one kernel serves every batch size; the vocabulary size is static, hence
    the model's)."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    try:
        for rows in (1, 3):
            logprobs = torch.zeros(rows, vocab_size, device=device).log_softmax(dim=-1, dtype=torch.float32)
            Sampler.gather_logprobs(logprobs, 1, torch.zeros(rows, dtype=torch.int64, device=device))
    except Exception:  # a job asking for logprobs will then fail alone, saying why
        log.exception("building vLLM's logprobs kernel before the seccomp filter failed")


class SandboxedWorker(_Worker):
    """Mixin for vLLM worker classes; see the module doc."""

    _nnqueue_sandboxed = False

    def init_device(self) -> None:
        super().init_device()
        if isolation.started_by_worker():  # else the logging of a library user's process, left alone
            logs.configure_engine_process()
        config = EngineConfig.from_environment()
        if config.protected_environment:
            protected.install(config.allowed_modules)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        times = super().compile_or_warm_up_model(*args, **kwargs)
        # Part of the engine's start rather than of its first step: the compiler run took 2.5-2.7 s of the first
        # job on a freshly started CPU worker (its tenth: 0.23 s end to end).
        if isolation.started_by_worker() and EngineConfig.from_environment().seccomp:
            started = time.monotonic()  # as root still: the kernel lands in root's inductor cache
            warm_up_jit(self.model_config.get_vocab_size(), self.device)
            log.info("built vLLM's logprobs kernel in %.1f s, before the seccomp filter", time.monotonic() - started)
        return times

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        if not self._nnqueue_sandboxed:
            self._nnqueue_enter_sandbox()
        return super().execute_model(*args, **kwargs)

    def _nnqueue_enter_sandbox(self) -> None:
        if isolation.started_by_worker():  # else an engine a library user (or a test) built: it keeps its user
            init_method = str(getattr(self, "distributed_init_method", "") or "")
            rendezvous = Path(init_method.removeprefix("file://"))
            hand_over = [rendezvous] if init_method.startswith("file://") and rendezvous.exists() else []
            cuda = getattr(getattr(self, "device", None), "type", None) == "cuda"  # Triton compiles at run time
            enter_engine_sandbox(hand_over, jit_compiler=cuda, protected_environment=True)
        self._nnqueue_sandboxed = True


def enter_engine_sandbox(hand_over: list[Path], *, jit_compiler: bool, protected_environment: bool) -> None:
    """What an engine process that a worker started does before its first step: the engine user
    (:func:`nnqueue.isolation.enter_sandbox`, ``hand_over`` given to it, every thread checked), the seccomp filter
    (``jit_compiler``: exec stays allowed, for Triton's compiler on CUDA) and, in a process that runs users' code
    (``protected_environment``), the protected environment's lock-down. Nothing in another process."""
    if not isolation.started_by_worker():
        return
    config = EngineConfig.from_environment()
    isolation.enter_sandbox(hand_over=hand_over)
    filtered = config.seccomp and seccomp_filter.install(isolation.engine_needs_network(), exec_allowed=jit_compiler)
    if protected_environment and config.protected_environment:
        protected.lock_down()
    log.info(
        "engine process %d runs as uid %d, seccomp filter %s",
        os.getpid(),
        os.getuid(),
        ("applied (exec allowed: Triton's compiler)" if jit_compiler else "applied") if filtered else "NOT applied",
    )
