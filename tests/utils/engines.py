"""An engine in the test process, on its own loop, as a worker holds one."""

from __future__ import annotations

import os
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nnqueue.isolation import ENGINE_USER_ENV
from nnqueue.workers.engine_host import EngineHost

T = TypeVar("T")


@dataclass
class InProcessEngine:
    """An engine in the test process, on its own loop (an ``EngineHost``, as in a worker)."""

    host: EngineHost
    model: Any

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.host.call(coroutine)


@contextmanager
def running_engine(model_path: Path, **engine_kwargs: Any) -> Iterator[InProcessEngine]:
    """``model_path`` on a dispatched async engine with nnqueue's worker class, shut down on exit."""
    from nnqueue.engines.platform import load_engine

    async def load() -> Any:
        return load_engine(str(model_path), **engine_kwargs)

    host = EngineHost()
    # The engine stays this (root) process's user, so that tests can hand it files in their own
    # temporary folders; the drop to the engine user is tested on worker processes (test_isolation.py).
    previous = os.environ.get(ENGINE_USER_ENV)
    os.environ[ENGINE_USER_ENV] = ""
    try:
        engine = InProcessEngine(host, host.call(load()))
    finally:
        if previous is None:
            os.environ.pop(ENGINE_USER_ENV)
        else:
            os.environ[ENGINE_USER_ENV] = previous
    try:
        yield engine
    finally:
        engine.model.vllm_entrypoint.shutdown()
        # Drop it now: AsyncLLM.__del__ shuts down again, which fails at interpreter exit.
        engine.model.vllm_entrypoint = None
        host.stop()
