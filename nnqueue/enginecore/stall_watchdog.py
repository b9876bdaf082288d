"""Stops intervention code that never hands control back to the model.

Every job batched on an engine shares the engine's forward thread: nnsight runs each intervention in
a greenlet that the forward switches into (``Mediator.switch``) and that runs until it next waits
for a model value. A ``while True`` in one user's intervention would therefore stall every job on the
engine, and aborting its vLLM requests cannot help: the abort is only read between forward steps.

This runs inside the engine process. It times every switch into intervention code; a watchdog
thread raises :class:`InterventionStalled` inside a switch that has run longer than the stall
timeout (``PyThreadState_SetAsyncExc`` on the forward thread). nnsight's vLLM runner defers it like
any exception in user code (``defer_exceptions``), so only that request fails and the engine goes on.

The exception can only surface inside the timed switch: the watchdog decides and raises under the
same lock that the switch takes on its way out, and the switch clears a raise that has not yet been
delivered before it releases the lock.

The exception lands only when the stalled thread next runs bytecode, which code blocked in C (``time.sleep``,
a catastrophic regular expression) does not. In a vLLM engine, the switches are also published
(:mod:`nnqueue.enginecore.stall_beacon`) with the request whose intervention runs, so that the worker can kill
the engine process from outside (:mod:`nnqueue.workers.stall_deadline`) when the exception did not stop it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nnsight.intervention.interleaver import Mediator

from nnqueue.enginecore.crash_report import CRASH_DIR_ENV
from nnqueue.enginecore.stall_beacon import Beacon
from nnqueue.errors import NNqueueError


class InterventionStalled(NNqueueError):
    """Intervention code ran too long without yielding to the model; raised inside it."""


@dataclass
class _Switch:
    thread_id: int
    started: float
    request_id: str = ""
    fired: bool = False


_lock = threading.Lock()
_active: list[_Switch] = []  # innermost last: a switch may run a nested one (a module called from a block)
_installed: list[float] = []


def install(stall_timeout_s: float, request_id_of: Callable[[Mediator], str] | None = None) -> None:
    """Time every intervention switch in this process and start the watchdog; idempotent.

    ``request_id_of``: the request whose intervention a mediator runs; given (a vLLM engine), the switches are
    published in the crash report directory for the worker (:mod:`nnqueue.enginecore.stall_beacon`)."""
    if _installed:
        return
    _installed.append(stall_timeout_s)
    switch = Mediator.switch
    directory = os.environ.get(CRASH_DIR_ENV)
    beacon = Beacon(Path(directory)) if request_id_of is not None and directory else None

    def timed_switch(self: Mediator, *args: Any) -> Any:
        entry = _Switch(threading.get_ident(), time.monotonic())
        if beacon is not None and request_id_of is not None:
            entry.request_id = _cached_request_id(self, request_id_of)
        with _lock:
            _active.append(entry)
            if beacon is not None:
                beacon.publish(entry.started, entry.request_id)
        try:
            return switch(self, *args)
        finally:
            with _lock:
                _active.remove(entry)
                if entry.fired:
                    _set_async_exc(entry.thread_id, None)  # undelivered: it must not land outside
                if beacon is not None:  # the switch it was nested in, if any, runs on
                    beacon.publish(*((_active[-1].started, _active[-1].request_id) if _active else (0.0, "")))

    Mediator.switch = timed_switch
    threading.Thread(target=_watch, args=(stall_timeout_s,), name="nnqueue-stall-watchdog", daemon=True).start()


def _cached_request_id(mediator: Mediator, request_id_of: Callable[[Mediator], str]) -> str:
    """``request_id_of(mediator)``, kept on the mediator once found."""
    known = getattr(mediator, "nnqueue_request_id", "")
    if not known:
        known = mediator.nnqueue_request_id = request_id_of(mediator)
    return str(known)


def request_id_in(runner: Callable[[], Any]) -> Callable[[Mediator], str]:
    """``request_id_of`` for an engine whose model runner (nnsight's) ``runner()`` returns: the id of the request that
    carries the mediator (as its trace or as a registered block's copy), "" for none."""

    def request_id_of(mediator: Mediator) -> str:
        requests = getattr(getattr(runner(), "nnsight_requests", None), "requests", {})
        for request_id, request in list(requests.items()):
            if any(worker is mediator for worker in request.workers()):
                return str(request_id)
        return ""

    return request_id_of


def _watch(stall_timeout_s: float) -> None:
    stalled = _stalled_error(stall_timeout_s)
    while True:
        time.sleep(min(0.5, stall_timeout_s / 4))
        with _lock:
            innermost: dict[int, _Switch] = {entry.thread_id: entry for entry in _active}
            for entry in innermost.values():
                if not entry.fired and time.monotonic() - entry.started > stall_timeout_s:
                    entry.fired = True
                    _set_async_exc(entry.thread_id, stalled)


def _stalled_error(stall_timeout_s: float) -> type[InterventionStalled]:
    # CPython raises an asynchronous exception from its *type*, so the message rides on a subclass.
    message = (
        f"intervention code ran for more than {stall_timeout_s:g} s without returning control to the model"
        " (an endless loop?) and was stopped so that the engine's other jobs can go on"
    )

    class Stalled(InterventionStalled):
        def __init__(self, *args: Any) -> None:
            super().__init__(message)

    Stalled.__name__ = Stalled.__qualname__ = InterventionStalled.__name__
    return Stalled


def _set_async_exc(thread_id: int, exception_type: type[BaseException] | None) -> None:
    """Raise ``exception_type`` in thread ``thread_id`` at its next bytecode, or (None) cancel that."""
    target = ctypes.py_object(exception_type) if exception_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), target)
