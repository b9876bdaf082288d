"""An engine in the test process, on its own loop, as a worker holds one."""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from nnqueue.workers.engine_host import EngineHost

T = TypeVar("T")


@dataclass
class InProcessEngine:
    """An engine in the test process, on its own loop (an ``EngineHost``, as in a worker)."""

    host: EngineHost
    model: Any

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.host.call(coroutine)
