"""A job's timeline on the worker: when its run passed each point, for the benchmarks to print as percentiles.

A job's fixed cost is spread over the worker's threads and the engine's steps (issue 36): its claim, its payload,
building its requests, the engine's first and last step of them, the result written by the engine, committed to
the store, the job's row finished. `nnqueue.workers.job_execution.JobRunner` gives each run it starts a
`JobTimeline` (when it was given a `Timelines`), and the code along the run, in the workers and the engine
runners, stamps it with `stamp` (a context variable: no argument passes it down, and child tasks inherit it). A
stamp is one ``time.monotonic()`` into a dict, the first of each name kept; with no timeline (the default) it is
one context-variable read.

The points, in the order a job passes them:

* ``token``: the run began (a token was handed to the engine loop); ``claimed``: its job is RUNNING here;
* ``payload``: the payload read; ``built``: its requests ready (a steering job's: its prompts tokenized);
* ``submitted``: handed to the engine; ``first_output``: its first request's first output came back (the end of
  the first step that ran it); ``last_output``: its last request finished (the end of its last step);
* ``written``: the engine's report that it wrote the result (trace jobs; steering jobs: the job ended on every
  rank); ``committed``: the result is in the store; ``finished``: the job's row says how it ended.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections import deque
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

POINTS = (
    "token",
    "claimed",
    "payload",
    "built",
    "submitted",
    "first_output",
    "last_output",
    "written",
    "committed",
    "finished",
)
# Finished timelines kept (the latest), enough for one benchmark run's jobs.
KEPT = 1 << 16

_current: ContextVar[JobTimeline | None] = ContextVar("nnqueue_job_timeline", default=None)


@dataclass
class JobTimeline:
    """One run's stamps: point name -> ``time.monotonic()`` when the run first passed it."""

    stamps: dict[str, float] = field(default_factory=dict)


def stamp(point: str) -> None:
    """Note that the current job's run passed ``point`` (nothing when no timeline is being kept)."""
    timeline = _current.get()
    if timeline is not None and point not in timeline.stamps:
        timeline.stamps[point] = time.monotonic()


class Timelines:
    """The timelines of a worker's finished runs (the latest `KEPT`), and their percentiles."""

    def __init__(self) -> None:
        self.finished: deque[JobTimeline] = deque(maxlen=KEPT)

    @contextlib.contextmanager
    def run(self) -> Iterator[JobTimeline]:
        """Keep a timeline for the run in this context (an engine-loop task); it is kept when the run ends."""
        timeline = JobTimeline()
        reset = _current.set(timeline)
        try:
            yield timeline
        finally:
            _current.reset(reset)
            if "claimed" in timeline.stamps:  # a token that found no work ran no job
                self.finished.append(timeline)

    def clear(self) -> None:
        self.finished.clear()

    def percentiles(self) -> dict[str, dict[str, float]]:
        """Milliseconds from each point to the next one a job passed (``"payload -> built"``), in the order of
        `POINTS`, then of the whole run (its first point to its last): the p50, p90 and max over the timelines."""
        steps: dict[tuple[int, int], list[float]] = {}
        whole: list[float] = []
        for timeline in self.finished:
            passed = [(index, timeline.stamps[point]) for index, point in enumerate(POINTS) if point in timeline.stamps]
            for (before, start), (after, end) in itertools.pairwise(passed):
                steps.setdefault((before, after), []).append(end - start)
            whole.append(passed[-1][1] - passed[0][1])
        table = {f"{POINTS[a]} -> {POINTS[b]}": _summary(steps[a, b]) for a, b in sorted(steps)}
        return table | ({"whole run": _summary(whole)} if whole else {})


def _summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "jobs": len(ordered),
        "p50_ms": round(1e3 * statistics.median(ordered), 2),
        "p90_ms": round(1e3 * p90, 2),
        "max_ms": round(1e3 * ordered[-1], 2),
    }
