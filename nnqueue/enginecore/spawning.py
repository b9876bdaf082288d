"""Where the processes that run users' code are born: the engine's network namespace and its filesystem view.

The worker decides at start-up whether its engine runs in a network namespace of its own (:mod:`nnqueue.netns`)
and a private filesystem view (:mod:`nnqueue.mountns`), and exports both for the engine's processes
(``NNQUEUE_ENGINE_NETWORK``, ``NNQUEUE_ENGINE_VIEW``). Namespaces belong to threads: ``unshare`` moves only the
calling thread, and a process is born in the namespaces of the thread that forks it. A worker is
multi-threaded (ZMQ's I/O threads, Celery, the I/O pool), so it never moves itself; it moves a fresh thread,
which starts the process and ends (:func:`contained`):

* vLLM's engine core: vLLM spawns it in ``CoreEngineProcManager.__init__`` (``vllm.v1.engine.utils``) with
  ``proc.start()`` of a spawn-context process, on the thread that builds the engine. :func:`engine_core_contained`
  hands that start (the spawn context's ``SpawnProcess._Popen``, for the calling thread only) to a contained
  thread. The engine core's model-runner workers (tensor and pipeline parallelism: vLLM's ``mp`` executor
  spawns them from the engine core) are born in its namespaces and view.
* the worker's start-up probe (:func:`nnqueue.isolation.probe`), run where the engine will run.
* a child that starts single-threaded (a trace builder, the transformers engine) enters them itself, first thing
  (:func:`enter_if_asked`).

The view is entered before the network namespace: it lists the host's unix sockets (``/proc/net/unix``, which
shows the calling thread's network namespace) to cover them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.context import SpawnProcess
from typing import TYPE_CHECKING, Any, TypeVar

from nnqueue import cgroups, mountns, netns

if TYPE_CHECKING:
    from nnqueue.enginecore.core_forks import CoreForks

T = TypeVar("T")
log = logging.getLogger(__name__)


def contained(call: Callable[[], T], *, network: bool, view: mountns.View | None) -> T:
    """``call()`` on a fresh thread in ``view`` (None: the host's filesystem) and, with ``network``, a fresh
    loopback-only network namespace; the processes it starts are born there, and the thread ends afterwards."""

    def run() -> T:
        if view is not None:
            mountns.enter(view)
        if network:
            netns.new_namespace()
        return call()

    result: T = mountns.in_fresh_thread(run)
    return result


@contextlib.contextmanager
def engine_core_contained(
    *, network: bool, view: mountns.View | None, forks: CoreForks | None = None
) -> Iterator[None]:
    """While the body builds a vLLM engine on this thread, the spawn-context processes this thread starts (the
    engine core) are forked by ``forks`` (:mod:`nnqueue.enginecore.core_forks`: the child enters the namespaces
    itself) or else started by a contained thread (:func:`contained`) and put in the engine's cgroup
    (:mod:`nnqueue.cgroups`); other threads' spawns are left alone."""
    group = cgroups.asked()
    if not network and view is None and forks is None and group is None:
        yield
        return
    owner = threading.get_ident()
    original: Callable[[Any], Any] = SpawnProcess._Popen

    def popen(process_obj: Any) -> Any:
        if threading.get_ident() != owner:
            return original(process_obj)
        # multiprocessing's resource tracker (a process of its own, started by the first spawn) is the worker's:
        # started here, it would be born in the engine's namespaces and clean up in the engine's /dev/shm.
        resource_tracker.ensure_running()
        if forks is not None:
            try:
                popen = forks.popen(process_obj)
            except ConnectionError as error:
                log.warning("%s: the engine core is spawned", error)
            else:
                log.info("the engine core (pid %d) is forked by the trace builders' zygote", popen.pid)
                return popen
        spawned = contained(lambda: original(process_obj), network=network, view=view)
        if group is not None:  # the fresh interpreter imports Python for seconds before it runs a user's code
            group.place(spawned.pid)
        return spawned

    SpawnProcess._Popen = staticmethod(popen)  # type: ignore[method-assign]
    try:
        yield
    finally:
        SpawnProcess._Popen = staticmethod(original)  # type: ignore[method-assign,assignment]


def enter_if_asked() -> None:
    """What a child that runs users' code calls first, while it has one thread: the engine's cgroup (while
    root in the host's view), the view, then the network namespace, that the worker exported."""
    cgroups.join_if_asked()
    mountns.enter_if_asked()
    netns.isolate_if_asked()
