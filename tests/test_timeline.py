"""Job timelines: the stamps of a run land in its own timeline (child tasks included), the first of each point is
kept, a run that claimed nothing is not kept, and the percentiles are per step between the points a job passed."""

from __future__ import annotations

import asyncio

import pytest

from nnqueue import timeline
from nnqueue.timeline import Timelines, stamp


def test_each_run_keeps_its_own_stamps_and_child_tasks_stamp_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(100))
    monkeypatch.setattr(timeline.time, "monotonic", lambda: float(next(clock)))
    timelines = Timelines()

    async def run(claimed: bool) -> None:
        with timelines.run():
            stamp("token")
            if claimed:
                stamp("claimed")
                await asyncio.gather(asyncio.create_task(_outputs()), asyncio.create_task(_outputs()))
                stamp("finished")

    async def both() -> None:
        await asyncio.gather(run(True), run(False))

    asyncio.run(both())
    (kept,) = timelines.finished  # the run that found no job is not kept
    assert list(kept.stamps) == ["token", "claimed", "first_output", "finished"]
    assert kept.stamps["first_output"] < kept.stamps["finished"]  # the first of the two child tasks' stamps


async def _outputs() -> None:
    stamp("first_output")
    await asyncio.sleep(0)


def test_no_timeline_no_stamps() -> None:
    stamp("claimed")  # outside any run: nothing to stamp, nothing raised
    timelines = Timelines()
    assert timelines.percentiles() == {}


def test_percentiles_are_per_step_between_the_points_passed() -> None:
    timelines = Timelines()
    for index in range(10):
        with timelines.run() as run:
            run.stamps.update({"token": 0.0, "claimed": 0.001 * (index + 1), "finished": 1.0})
    with timelines.run() as run:  # a job that failed before its payload: no "payload", the steps still line up
        run.stamps.update({"token": 0.0, "claimed": 0.5, "written": 0.75, "finished": 1.0})
    table = timelines.percentiles()
    assert list(table) == [
        "token -> claimed",
        "claimed -> written",
        "claimed -> finished",
        "written -> finished",
        "whole run",
    ]
    assert table["token -> claimed"] == {"jobs": 11, "p50_ms": 6.0, "p90_ms": 10.0, "max_ms": 500.0}
    assert table["claimed -> written"]["jobs"] == 1 and table["whole run"]["p50_ms"] == 1000.0
