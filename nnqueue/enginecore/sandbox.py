"""The engine processes' side of isolation: the protected environment, and the drop to the engine user.

Mixed into both engine worker classes (``cpu_worker``, ``gpu_worker``), first in their bases:

* ``init_device``: the protected environment (:mod:`nnqueue.enginecore.protected`) is installed before
  any payload can arrive;
* the first ``execute_model``: a root engine switches to the engine user
  (:func:`nnqueue.isolation.drop_privileges`). Users' code arrives only with requests (nnsight's runner
  unpickles a request's mediator inside ``execute_model``), and by then the engine is entirely up: model
  loaded, KV cache allocated, graphs compiled and captured, and the ZMQ sockets to the frontend connected.
  Earlier is too early: vLLM's engine core connects its input and output sockets (``ipc://`` files the
  root frontend created) only after ``compile_or_warm_up_model`` returns (vLLM 0.32 and 0.24). The one file
  the process still opens afterwards, the ``file://`` rendezvous of torch.distributed's ``FileStore``
  (CPU platform), is handed to the engine user first.

Settings come from the environment only (the worker exports them, see
``Settings.engine_environment``): ``.env`` is never read here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from nnqueue import isolation
from nnqueue.enginecore import protected
from nnqueue.settings import Settings

log = logging.getLogger(__name__)


def engine_settings() -> Settings:
    """The engine's settings: environment variables only, never a ``.env`` file."""
    return Settings(_env_file=None)


class SandboxedWorker:
    """Mixin for vLLM worker classes; see the module doc."""

    _nnqueue_sandboxed = False

    def init_device(self) -> None:
        super().init_device()  # type: ignore[misc]
        settings = engine_settings()
        if settings.protected_environment:
            protected.install(settings.allowed_modules)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        if not self._nnqueue_sandboxed:
            self._nnqueue_enter_sandbox()
        return super().execute_model(*args, **kwargs)  # type: ignore[misc]

    def _nnqueue_enter_sandbox(self) -> None:
        init_method = str(getattr(self, "distributed_init_method", "") or "")
        rendezvous = Path(init_method.removeprefix("file://"))
        hand_over = [rendezvous] if init_method.startswith("file://") and rendezvous.exists() else []
        isolation.enter_sandbox(hand_over=hand_over)
        self._nnqueue_sandboxed = True
        log.info("engine process %d runs users' code as uid %d", os.getpid(), os.getuid())
