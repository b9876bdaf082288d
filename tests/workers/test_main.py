"""The worker's start-up: the heap made while the engine loaded is frozen out of garbage collection."""

from __future__ import annotations

import gc


def test_the_startup_heap_is_out_of_the_collectors_reach() -> None:
    from nnqueue.workers.main import freeze_startup_heap  # imports vLLM: only when the test runs

    startup = [[index] for index in range(10_000)]  # container objects the collector tracks
    before = gc.get_freeze_count()  # an in-process vLLM engine core freezes its own start-up
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= before + len(startup)
        assert not any(obj is startup for obj in gc.get_objects())  # in no generation a collection walks
    finally:
        gc.unfreeze()
