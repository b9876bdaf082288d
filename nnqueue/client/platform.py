"""Let a CPU-only machine build the meta ``VLLM`` that traces are written against.

Building even a meta model makes vLLM's loader call ``torch.accelerator.empty_cache``, which raises
"Cannot access accelerator device when none is available" on a machine without one. vLLM's own CPU
worker avoids it by importing ``vllm.v1.worker.cpu.shm`` (a no-op accelerator, streams and events);
on vLLM's CPU platform the client does the same, as soon as vLLM is imported, so a user's
``VLLM(path)`` works whether it comes before or after ``import nnqueue.client``. Importing the client
never imports vLLM itself: until something else does, only a finder that waits for it is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any


def install() -> None:
    """Apply the CPU shim now if vLLM is loaded, else once it is; idempotent."""
    if "vllm" in sys.modules:
        _apply()
    elif not any(isinstance(finder, _AfterVLLMImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterVLLMImport())


def _apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.v1.worker.cpu.shm  # noqa: F401  (patches torch on import)


class _AfterVLLMImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``vllm`` so the shim runs right after it is imported."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != "vllm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # what the other finders would have found
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_apply(module: ModuleType) -> None:
            exec_module(module)
            _apply()

        loader.exec_module = exec_then_apply  # type: ignore[method-assign]
        return spec
