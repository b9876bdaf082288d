"""The worker's drain (nnqueue.workers.drain) on its own: SIGTERM stops the taking of work at once and only once;
running work gets the drain, then is handed back; work that ends within the drain is not; unset, it waits."""

from __future__ import annotations

import threading
import time

from nnqueue.workers.drain import Drain


class Work:
    def __init__(self, running: int) -> None:
        self.running, self.stops, self.handed_back = running, 0, []

    def stop(self) -> None:
        self.stops += 1

    def hand_back(self, reason: str) -> None:
        self.handed_back.append(reason)
        self.running = 0


def test_work_still_running_when_the_drain_ends_is_handed_back_once() -> None:
    work = Work(running=2)
    drain = Drain(0.5, work.stop, lambda: work.running, work.hand_back)
    started = time.monotonic()
    drain.begin()
    drain.begin()  # a second SIGTERM changes nothing
    assert work.stops == 1 and work.handed_back == []
    drain.finish()
    assert 0.5 <= time.monotonic() - started < 5
    assert work.handed_back == ["the worker stopped; not finished within its drain of 0.5 s"]


def test_work_that_ends_within_the_drain_is_not_handed_back() -> None:
    work = Work(running=1)
    drain = Drain(5, work.stop, lambda: work.running, work.hand_back)
    drain.begin()
    threading.Timer(0.3, lambda: setattr(work, "running", 0)).start()
    started = time.monotonic()
    drain.finish()
    assert time.monotonic() - started < 2 and work.handed_back == []


def test_without_a_limit_it_waits_for_the_work_to_end() -> None:
    work = Work(running=1)
    drain = Drain(None, work.stop, lambda: work.running, work.hand_back)
    threading.Timer(1.0, lambda: setattr(work, "running", 0)).start()
    started = time.monotonic()
    drain.finish()  # also begins it: no signal came
    assert time.monotonic() - started >= 1.0 and work.stops == 1 and work.handed_back == []


def test_celerys_shutdown_signal_begins_it_and_is_let_go_when_it_finished() -> None:
    from celery import signals

    receivers = len(signals.worker_shutting_down.receivers)
    work = Work(running=0)
    drain = Drain(None, work.stop, lambda: work.running, work.hand_back)
    drain.connect()
    assert len(signals.worker_shutting_down.receivers) == receivers + 1
    signals.worker_shutting_down.send(sender="nnqueue-x@host", sig="SIGTERM", how="Warm", exitcode=0)
    assert work.stops == 1
    drain.finish()
    assert len(signals.worker_shutting_down.receivers) == receivers


def test_a_cold_shutdown_hands_back_at_once() -> None:
    from celery import signals

    work = Work(running=1)
    drain = Drain(None, work.stop, lambda: work.running, work.hand_back)
    drain.connect()
    signals.worker_shutting_down.send(sender="nnqueue-x@host", sig="SIGTERM", how="Warm", exitcode=0)
    time.sleep(0.5)
    assert work.handed_back == []  # no limit: it waits
    signals.worker_shutting_down.send(sender="nnqueue-x@host", sig="SIGQUIT", how="Cold", exitcode=1)
    started = time.monotonic()
    drain.finish()
    assert time.monotonic() - started < 2 and work.handed_back == ["the worker stopped; cold shutdown"]
