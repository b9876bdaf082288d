"""nnqueue.workers.engine_liveness: the probe's round trips to the engine heal a death that no job saw, also when the
round trip pending at the death is never answered, on both databases (the worker's health is real; the engine is a
stand-in for vLLM's client in the two states the probe meets: a real engine killed at the moment a round trip is
pending is what tests/workers/test_engine_restart.py's last test met by chance)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from nnqueue.db.session import make_engine, session_factory
from nnqueue.workers.engine_health import EngineHealth
from nnqueue.workers.engine_liveness import keep_probing


class DeadEngine:
    """vLLM's ``AsyncLLM`` once its core died: ``errored``, and a round trip sent before the death never answered
    (vLLM 0.32's client ends its output task without failing the pending utility calls:
    ``core_client.process_outputs_socket``)."""

    errored = True

    async def is_sleeping(self) -> bool:
        await asyncio.Event().wait()
        raise AssertionError("never answered")


class LiveEngine:
    errored = False

    def __init__(self) -> None:
        self.answered = 0

    async def is_sleeping(self) -> bool:
        self.answered += 1
        return False


def test_a_dead_engine_that_never_answers_the_probe_is_replaced(any_database: str, tmp_path: Path) -> None:
    serving: list[DeadEngine | LiveEngine] = [DeadEngine()]

    async def restart(why: str) -> None:  # the worker's EngineRestart; a real one: tests/workers/test_engine_restart.py
        serving[0] = LiveEngine()

    stopped: list[bool] = []
    health = EngineHealth(
        session_factory(make_engine(any_database)),
        None,  # type: ignore[arg-type]
        "w1",
        "m",
        tmp_path,
        engine_errored=lambda: serving[0].errored,
        stop=lambda: stopped.append(True),
        restart=restart,
    )

    async def probe() -> None:
        task = asyncio.create_task(keep_probing("m", lambda: serving[0], health, interval_s=0.05))
        deadline = time.monotonic() + 10
        while not (isinstance(fresh := serving[0], LiveEngine) and fresh.answered >= 2):
            assert time.monotonic() < deadline, "the dead engine was never replaced: the probe waits on it"
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(probe())
    assert health.generation == 1 and not health.dead.is_set() and stopped == []
