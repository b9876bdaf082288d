"""The engine processes' side of isolation: the protected environment, and the drop to the engine user.

Mixed into both engine worker classes (``cpu_worker``, ``gpu_worker``), first in their bases:

* ``init_device``: the protected environment (:mod:`nnqueue.enginecore.protected`) is installed before
  any payload can arrive (it refuses what intervention code may not do while it runs);
* the first ``execute_model``: a root engine switches to the engine user
  (:func:`nnqueue.isolation.drop_privileges`). Users' code arrives only with requests (nnsight's runner
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the mixin goes before a vLLM worker class in the bases
    from vllm.v1.worker.worker_base import WorkerBase as _Worker
else:
    _Worker = object

from nnqueue import isolation
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

    @classmethod
    def from_environment(cls) -> EngineConfig:
        env = os.environ
        return cls(
            stall_timeout_s=float(env.get("NNQUEUE_ENGINE_STALL_TIMEOUT_S", cls.stall_timeout_s)),
            protected_environment=env.get("NNQUEUE_PROTECTED_ENVIRONMENT", "true").strip().lower()
            not in ("false", "0", "no", "off"),
            allowed_modules=tuple(
                name.strip() for name in env.get("NNQUEUE_ALLOWED_MODULES", "").split(",") if name.strip()
            ),
        )


# What a job in a child process (a trace builder, the transformers engine) imports: imported before the drop,
# since the engine user may not read this interpreter's files (a Python in root's home).
JOB_MODULES = (
    "nnsight.intervention.errors",
    "nnsight.schema.request",
    "nnsight.tracing.tracer",
    "nnsight.tracing.util",
    "nnqueue.enginecore.trace_results",
)


def enter_child_sandbox() -> EngineConfig:
    """What a child process that runs users' code (a trace builder, the transformers engine) does once its model
    is loaded and before the first payload: import what jobs use, scrub the secrets and, when root, drop to the
    engine user, then install the protected environment. Returns the engine's settings."""
    for name in JOB_MODULES:
        importlib.import_module(name)
    isolation.enter_sandbox()
    config = EngineConfig.from_environment()
    if config.protected_environment:
        protected.install(config.allowed_modules)
        protected.lock_down()
    return config


class SandboxedWorker(_Worker):
    """Mixin for vLLM worker classes; see the module doc."""

    _nnqueue_sandboxed = False

    def init_device(self) -> None:
        super().init_device()
        config = EngineConfig.from_environment()
        if config.protected_environment:
            protected.install(config.allowed_modules)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        if not self._nnqueue_sandboxed:
            self._nnqueue_enter_sandbox()
        return super().execute_model(*args, **kwargs)

    def _nnqueue_enter_sandbox(self) -> None:
        init_method = str(getattr(self, "distributed_init_method", "") or "")
        rendezvous = Path(init_method.removeprefix("file://"))
        hand_over = [rendezvous] if init_method.startswith("file://") and rendezvous.exists() else []
        isolation.enter_sandbox(hand_over=hand_over)
        if EngineConfig.from_environment().protected_environment:
            protected.lock_down()
        self._nnqueue_sandboxed = True
        log.info("engine process %d runs users' code as uid %d", os.getpid(), os.getuid())
