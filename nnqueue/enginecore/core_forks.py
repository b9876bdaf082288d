"""vLLM's engine core forked from the trace builders' zygote instead of spawned: a start without vLLM's import.

vLLM starts its engine core as a spawn-context process (``CoreEngineProcManager`` in ``vllm.v1.engine.utils``): a
fresh interpreter that imports vLLM, torch and transformers again (13-15 s of CPU on a 2-core machine, 16 s on a GPU
host) at every start and every in-place restart of a worker's engine. The builders' zygote
(:mod:`nnqueue.enginecore.zygote`) has imported all of it already (``nnqueue.engines.trace_builder.serve_engine_cores``
adds what only a core imports). So, right after its imports and before it loads its meta model, it forks a *core
server* (:func:`serve_aside`), which runs no user code and only forks engine cores on the worker's request, and the
worker starts its engine core there (:class:`CoreForks`, used by
:func:`nnqueue.enginecore.spawning.engine_core_contained`).

The start is multiprocessing's forkserver start with this server in place of the global one:
:class:`ForkedCorePopen` is ``multiprocessing.popen_forkserver.Popen`` (the process object and its preparation data
pickled into a pipe, the child runs ``multiprocessing.spawn._main`` on it; the server writes the child's pid, then
its exit code, into the sentinel pipe that vLLM watches). What a spawned core gets from the worker, the forked one is
handed: the worker's environment at that moment (its secrets were scrubbed before the engine started), its stdout
and stderr, its resource tracker and the descriptors the process object carries. Single-threaded after the fork, the
child enters the engine's filesystem view and network namespace itself (:func:`spawning.enter_if_asked`), where a
spawned core is born in them; from there it is the spawned core: the same sandbox, the drop to the engine user and
the seccomp filter on its first step (:mod:`nnqueue.enginecore.sandbox`), and it ends with the worker
(:mod:`nnqueue.enginecore.lifetime`). The zygote's heap it starts from holds no secret: the zygote was started with
the scrubbed environment and has loaded only modules.

The server outlives a zygote that dies (its engine cores are not the builders': they keep serving) and exits once the
worker closed its socket and its last engine core has ended. Where it is not there (no builders; a zygote that did
not load), the worker spawns the core as before. On a GPU the zygote has created no CUDA context (it imports the CUDA
worker's modules, which create none, and leaves out inductor's system key, which would), so each forked core creates
its own, as a spawned one does; should one exist, the zygote declines (closes the socket) and the worker spawns. One
H200, Llama-3-8B shape: an in-place restart 12-13 s forked against 32-33 s spawned
(``benchmarks/results/h200-restart-{forked,spawned}-8b.json``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Iterable
from multiprocessing import forkserver, popen_forkserver, reduction, resource_tracker, spawn, util
from multiprocessing.context import set_spawning_popen
from pathlib import Path
from typing import Any

from nnqueue.enginecore import spawning, zygote
from nnqueue.enginecore.zygote import CORE_FORKS_FD_ENV
from nnqueue.libc import check, libc

log = logging.getLogger(__name__)
_LENGTH = struct.Struct("!Q")
_MAX_FDS = 64
_PR_SET_CHILD_SUBREAPER = 36


# The zygote's side.


def channel() -> socket.socket | None:
    """The zygote's socket for its core server, when the worker passed one (``NNQUEUE_CORE_FORKS_FD``, removed from
    the environment its children inherit)."""
    fd = os.environ.pop(CORE_FORKS_FD_ENV, None)
    return None if fd is None else socket.socket(fileno=int(fd))


def serve_aside(worker: socket.socket, pool: socket.socket) -> None:
    """Fork the core server, which serves ``worker`` (``pool``, the zygote's socket to the builder pool, is not
    the server's). Returns in the zygote, and in each engine core once it ended (raising ``SystemExit`` with its exit
    code, as a spawned child ends: its threads joined, its exit handlers run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() != 0:
        worker.close()
        return
    try:
        pool.close()
        core = _serve(worker)
    except BaseException:  # noqa: BLE001 - whatever ends the server, reported before it exits
        traceback.print_exc()
        os._exit(1)
    if core is None:
        os._exit(0)
    try:
        code = _become_core(*core)
    except BaseException:  # noqa: BLE001 - a core that could not start, reported as a spawned one's would be
        traceback.print_exc()
        code = 1
    sys.exit(code)


def _serve(worker: socket.socket) -> list[int] | None:
    """Say the server is ready, fork an engine core for each request until the worker closes the socket, then wait
    for the cores still running. Returns in each core (the descriptors it was handed), and None in the server once
    it is done.

    Nothing a core started outlives it: the server is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a process
    that a core or its descendants started and left (a daemon forked twice, a core's model runners and whatever a
    killed core was running) becomes the server's child instead of the host's init, and the server kills every child
    of its that is not a running core (`_strays`) before it forks the next. A CUDA engine keeps ``fork`` and ``exec``
    (Triton's compiler): a third red-team round forked a process from one domain's engine that outlived the
    engine's replacement at a trust-domain switch and read the next domain's results in the handoff folder."""
    check(libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)", OSError)
    worker.send(b"ready")
    statuses: dict[int, int] = {}  # a running core's pid: the write end of its sentinel
    killed: set[int] = set()  # strays killed and not yet reaped
    while True:
        for pid, code in zygote.reaped():
            if (status := statuses.pop(pid, None)) is not None:
                with contextlib.suppress(OSError):
                    forkserver.write_signed(status, code)
                os.close(status)
        strays = _strays(statuses.keys(), killed)
        if worker.fileno() < 0:
            if not statuses and not strays:
                return None
            select.select([], [], [], zygote.REAP_INTERVAL_S)
            continue
        if not select.select([worker], [], [], zygote.REAP_INTERVAL_S)[0]:
            continue
        message, fds, _, _ = socket.recv_fds(worker, zygote.MESSAGE_BYTES, _MAX_FDS)
        if not message:
            worker.close()
            continue
        if len(fds) < 5:
            for fd in fds:
                os.close(fd)
            continue
        data, status, *passed = fds
        pid = os.fork()
        if pid == 0:
            worker.close()
            for fd in (status, *statuses.values()):
                os.close(fd)
            return [data, *passed]
        with contextlib.suppress(OSError):
            forkserver.write_signed(status, pid)
        statuses[pid] = status
        for fd in (data, *passed):
            os.close(fd)


def _strays(cores: Iterable[int], killed: set[int]) -> set[int]:
    """Kill the server's children that are not ``cores`` and not ``killed`` already (see `_serve`; ``killed`` is
    kept up to date); the pids of all that are not cores (reaped at a later pass)."""
    path = f"/proc/self/task/{os.getpid()}/children"  # the server has one thread, which adopts the orphans
    try:
        children = {int(pid) for pid in Path(path).read_text().split()}
    except FileNotFoundError:  # a kernel built without CONFIG_PROC_CHILDREN
        import psutil  # vLLM's dependency: there wherever engine cores run

        children = {child.pid for child in psutil.Process().children()}
    strays = children - set(cores)
    killed &= strays
    for pid in strays - killed:
        killed.add(pid)
        log.warning("killing process %d, which an engine core started and left behind", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return strays


def _become_core(data: int, stdout: int, stderr: int, tracker: int, *inherited: int) -> int:
    """The forked child: the worker's environment, output and resource tracker, the engine's view and network, then
    multiprocessing's child start on the process object the worker wrote into ``data``; the process's exit code."""
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    with contextlib.suppress(ImportError):  # vLLM titles the core with it (VLLM::EngineCore): it needs the environment
        import setproctitle  # in place when it starts, so it starts before the environment is replaced

        setproctitle.getproctitle()
    environ = pickle.loads(_read_exactly(data, _LENGTH.unpack(_read_exactly(data, _LENGTH.size))[0]))
    os.environ.clear()
    os.environ.update(environ)
    spawning.enter_if_asked()
    resource_tracker._resource_tracker._fd = tracker  # type: ignore[attr-defined]
    forkserver._forkserver._inherited_fds = list(inherited)  # type: ignore[attr-defined]
    code: int = spawn._main(data, os.dup(data))
    return code


def _read_exactly(fd: int, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = os.read(fd, size - len(chunks))
        if not chunk:
            raise EOFError("the worker closed the pipe before the engine core's start was read")
        chunks += chunk
    return bytes(chunks)


# The worker's side.


class CoreForks:
    """The worker's end of a zygote's core server (one per zygote process); used from the thread that builds the
    engine."""

    def __init__(self, ours: socket.socket) -> None:
        self._socket = ours
        self._ready = False

    def ready(self, timeout_s: float) -> bool:
        """Whether the server is up, waiting up to ``timeout_s`` for its ``ready`` (the zygote's imports); False when
        the zygote declined (not the CPU platform), ended, or did not load in time."""
        if self._ready or self._socket.fileno() < 0:
            return self._ready
        if select.select([self._socket], [], [], timeout_s)[0]:
            self._ready = self._socket.recv(zygote.MESSAGE_BYTES) == b"ready"
        return self._ready

    def popen(self, process_obj: Any) -> ForkedCorePopen:
        """Start ``process_obj`` (a spawn-context process) forked by the server; raises ``ConnectionError`` when the
        server is gone before it forked (start it otherwise)."""
        return ForkedCorePopen(process_obj, self)

    def request(self, fds: list[int]) -> tuple[int, int]:
        """Ask for a fork handed ``fds``; the sentinel (the pid, then the exit code) and the data pipe's write end."""
        data_r, data_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            tracker = resource_tracker.getfd()
            assert tracker is not None  # getfd starts the tracker
            socket.send_fds(self._socket, [b"C"], [data_r, status_w, 1, 2, tracker, *fds])
        except OSError as error:
            os.close(status_r)
            os.close(data_w)
            raise ConnectionError(f"the engine core server is gone: {error}") from error
        finally:
            os.close(data_r)
            os.close(status_w)
        return status_r, data_w

    def close(self) -> None:
        self._socket.close()


class ForkedCorePopen(popen_forkserver.Popen):
    """``multiprocessing.popen_forkserver.Popen``, its process forked by a :class:`CoreForks` server."""

    def __init__(self, process_obj: Any, forks: CoreForks) -> None:
        self._forks = forks
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        environ = pickle.dumps(dict(os.environ))
        buffer = io.BytesIO()
        buffer.write(_LENGTH.pack(len(environ)) + environ)
        set_spawning_popen(self)
        try:
            reduction.dump(spawn.get_preparation_data(process_obj._name), buffer)
            reduction.dump(process_obj, buffer)
        finally:
            set_spawning_popen(None)
        self.sentinel, data = self._forks.request(self._fds)  # type: ignore[attr-defined]
        parent = os.dup(data)  # the child's sentinel of the worker, as multiprocessing keeps one
        self.finalizer = util.Finalize(self, util.close_fds, (parent, self.sentinel))  # type: ignore[attr-defined]
        try:
            self.pid = forkserver.read_signed(self.sentinel)
        except (OSError, EOFError) as error:
            os.close(data)
            raise ConnectionError("the engine core server ended before it forked the engine core") from error
        with open(data, "wb", closefd=True) as pipe:
            pipe.write(buffer.getbuffer())
