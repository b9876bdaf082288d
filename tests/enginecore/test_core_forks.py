"""Engine cores forked by the zygote's core server: the process vLLM would have spawned, its exit seen, a fallback.

The zygote here is a plain interpreter that serves core forks with nothing preloaded (a real worker's imports vLLM
first: tests/workers/test_worker.py checks that its engine core is forked so); the process started is a
spawn-context ``multiprocessing`` process, as vLLM's engine core is.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import psutil
import pytest

from nnqueue.enginecore import spawning
from nnqueue.enginecore.core_forks import CoreForks
from nnqueue.enginecore.zygote import CORE_FORKS_FD_ENV

ZYGOTE = """
import signal, socket
from nnqueue.enginecore import core_forks
core_forks.serve_aside(core_forks.channel(), socket.socket())
signal.pause()
"""
CONTEXT = multiprocessing.get_context("spawn")


def _report(answer: Connection, code: int) -> None:
    """The started process: what it sees, back through a pipe it was handed; then it exits with ``code``."""
    parent = multiprocessing.parent_process()
    answer.send(
        {
            "ppid": os.getppid(),
            "parent": parent.pid if parent is not None else None,
            "handed": os.environ.get("NNQUEUE_TEST_HANDED"),
            "dropped": os.environ.get("NNQUEUE_TEST_DROPPED"),
            "name": multiprocessing.current_process().name,
        }
    )
    print("the forked core writes to the worker's stdout", flush=True)
    sys.exit(code)


def _leave_processes(answer: Connection) -> None:
    """The started process: a child of its own and a daemon forked twice (its parent gone at once), both sleeping,
    each sending its pid through the pipe; then it waits to be killed."""
    if os.fork() == 0:
        answer.send({"child": os.getpid()})
        time.sleep(600)
        os._exit(0)
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:
            answer.send({"daemon": os.getpid()})
            time.sleep(600)
        os._exit(0)
    os.waitpid(middle, 0)
    time.sleep(600)


@pytest.fixture
def forks(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[CoreForks, psutil.Process]]:
    """A zygote serving core forks, and the worker's end of its server."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setenv("NNQUEUE_TEST_DROPPED", "the zygote's, not the worker's")
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE],
        env={**os.environ, CORE_FORKS_FD_ENV: str(theirs.fileno())},
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    monkeypatch.delenv("NNQUEUE_TEST_DROPPED")
    monkeypatch.setenv("NNQUEUE_TEST_HANDED", "the worker's at the start")
    served = CoreForks(ours)
    try:
        assert served.ready(60), "the zygote's core server never said it was ready"
        yield served, psutil.Process(zygote.pid)
    finally:
        served.close()
        zygote.kill()
        zygote.wait()


def test_a_forked_core_runs_as_a_spawned_one_would_and_its_exit_code_reaches_the_worker(
    forks: tuple[CoreForks, psutil.Process], capfd: pytest.CaptureFixture[str]
) -> None:
    served, zygote = forks
    reader, writer = CONTEXT.Pipe(duplex=False)
    process = CONTEXT.Process(target=_report, args=(writer, 3), name="EngineCore")
    with spawning.engine_core_contained(network=False, view=None, forks=served):
        process.start()
    [server] = zygote.children()
    assert process.pid in {child.pid for child in server.children()}  # forked by the server, not spawned here
    seen = reader.recv()
    process.join(30)
    assert process.exitcode == 3
    assert seen == {
        "ppid": server.pid,
        "parent": os.getpid(),  # multiprocessing's parent: the worker that started it
        "handed": "the worker's at the start",
        "dropped": None,
        "name": "EngineCore",
    }
    assert "the forked core writes to the worker's stdout" in capfd.readouterr().out


def test_a_killed_core_is_seen_dead_and_the_server_outlives_its_zygote_until_its_cores_end(
    forks: tuple[CoreForks, psutil.Process],
) -> None:
    served, zygote = forks
    reader, _writer = CONTEXT.Pipe(duplex=False)
    waiting = CONTEXT.Process(target=reader.recv)  # runs until killed: nothing is ever sent (_writer stays open)
    with spawning.engine_core_contained(network=False, view=None, forks=served):
        waiting.start()
    [server] = zygote.children()
    zygote.kill()  # a zygote that dies takes its builders, not the engine core
    zygote.wait(10)
    served.close()  # and the worker lets the server go: it waits for its core
    time.sleep(0.5)
    assert waiting.is_alive() and server.is_running()
    waiting.kill()
    waiting.join(10)
    assert waiting.exitcode == -9
    server.wait(10)  # raises if the server did not exit with its last core


def test_a_core_is_spawned_when_the_server_is_gone(forks: tuple[CoreForks, psutil.Process]) -> None:
    served, _ = forks
    served.close()
    reader, writer = CONTEXT.Pipe(duplex=False)
    process = CONTEXT.Process(target=_report, args=(writer, 0))
    with spawning.engine_core_contained(network=False, view=None, forks=served):
        process.start()
    assert reader.recv()["ppid"] == os.getpid()
    process.join(60)
    assert process.exitcode == 0


def test_nothing_a_core_started_outlives_it(forks: tuple[CoreForks, psutil.Process]) -> None:
    """A CUDA engine may fork (Triton's compiler): a daemon it leaves is killed at once, a child with the core."""
    served, _ = forks
    reader, writer = CONTEXT.Pipe(duplex=False)
    process = CONTEXT.Process(target=_leave_processes, args=(writer,))
    with spawning.engine_core_contained(network=False, view=None, forks=served):
        process.start()
    pids = {**reader.recv(), **reader.recv()}
    assert _gone(pids["daemon"], 10), "a daemon the core forked (its parent gone) still runs"
    assert psutil.pid_exists(pids["child"]) and process.is_alive()
    process.kill()
    process.join(10)
    assert _gone(pids["child"], 10), "the core's child still runs after the core was killed"


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while psutil.pid_exists(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
