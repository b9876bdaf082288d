"""Children forked from a loaded parent: a pool's processes ready in milliseconds instead of a model load each.

A trace builder imports vLLM and nnsight and loads a meta model before it can answer: 13.8 s of CPU on a 2-core
machine, paid by every builder a worker starts (two at each start and restart) and by every fresh builder a trust
domain's switch asks for. A *zygote* pays it once: a process started as a pool's children are (``python -m ...``,
spawned fresh with the worker's environment less its secrets: ``child_process.scrubbed_environment``), which loads
what they share and then only forks, on the worker's request, a child that goes on from there (:func:`serve_forks`
returns in it). The zygote runs no user code and is never sandboxed; each child, single-threaded
after the fork, isolates and sandboxes itself as a freshly started child does (its own namespaces, the engine user,
the seccomp filter, the protected environment), keeps only its own pipes to the worker (every other descriptor of the
zygote closed) and carries nothing of another child: a child that ran a trust domain's code changes only its own copy
of the zygote's memory.

The worker's side is :class:`Zygote`: it starts the process, and each :meth:`Zygote.fork` sends it the child's stdin
and stdout (two pipes, passed over a unix socket) and gets back a :class:`ForkedChild`, which the pool uses as it
would an ``asyncio.subprocess.Process``. The zygote reaps its children and reports their exit codes; a zygote that
dies takes its children down with it and the next fork starts another.

Messages from the zygote, one per packet: ``ready`` (loaded), ``forked <pid>`` (the answer to a fork request: one
byte with two descriptors), ``exited <pid> <code>``.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nnqueue.enginecore.core_forks import CoreForks

ZYGOTE_FD_ENV = "NNQUEUE_ZYGOTE_FD"
CORE_FORKS_FD_ENV = "NNQUEUE_CORE_FORKS_FD"
REAP_INTERVAL_S = 0.05
MESSAGE_BYTES = 256


# The zygote's side.


def channel() -> socket.socket:
    """The zygote's socket to the worker (``NNQUEUE_ZYGOTE_FD``, removed from the environment its children inherit)."""
    fd = os.environ.pop(ZYGOTE_FD_ENV, None)
    if fd is None:
        raise RuntimeError(f"started without {ZYGOTE_FD_ENV}: this program runs as a worker's zygote only")
    return socket.socket(fileno=int(fd))


def serve_forks(worker: socket.socket) -> None:
    """Say the zygote is ready, then fork a child for each request until the worker closes the socket (then exit).
    Returns only in a forked child, whose stdin and stdout are the pipes the request brought, and which holds no other
    descriptor of the zygote's beyond stderr."""
    worker.send(b"ready")
    while True:
        for pid, code in reaped():
            worker.send(f"exited {pid} {code}".encode())
        if not select.select([worker], [], [], REAP_INTERVAL_S)[0]:
            continue
        message, fds, _, _ = socket.recv_fds(worker, 1, 2)
        if not message:
            os._exit(0)
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()  # nothing the zygote printed may reach a child's protocol
        pid = os.fork()
        if pid == 0:
            _become_child(*fds)
            return
        for fd in fds:
            os.close(fd)
        worker.send(f"forked {pid}".encode())


def _become_child(stdin: int, stdout: int) -> None:
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the worker's socket, the pipes just copied, anything else


def reaped() -> list[tuple[int, int]]:
    """The children that ended since the last call: pid and exit code (minus the signal that killed one)."""
    ended: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


# The worker's side.


class ForkedChild:
    """A child the zygote forked, as the pool uses an ``asyncio.subprocess.Process``: ``pid``, ``stdin`` (a stream
    writer), ``stdout`` (a stream reader), ``returncode``, :meth:`kill` and :meth:`wait`."""

    def __init__(self, pid: int, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        self._ended = asyncio.Event()
        try:  # signals go to this process even if the zygote reaped it and its pid was reused
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # it ended already, or a kernel before 5.3: by pid
            self._pidfd = None

    def kill(self) -> None:
        if self.returncode is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.stdin.close()
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            self._ended.set()


class Zygote:
    """The worker's zygote running ``command`` (its environment ``environment()``, called at each start); use it on
    one event loop only."""

    def __init__(
        self,
        name: str,
        command: list[str],
        environment: Callable[[], dict[str, str]],
        limit: int,
        *,
        core_forks: bool = False,
    ) -> None:
        self.name, self.command, self.environment, self.limit = name, command, environment, limit
        # ``core_forks``: each zygote process also forks a server of engine cores (nnqueue.enginecore.core_forks).
        self._serves_cores = core_forks
        self.core_forks: CoreForks | None = None  # the current zygote's core server
        self._process: asyncio.subprocess.Process | None = None
        self._socket: socket.socket | None = None
        self._ready: asyncio.Future[None] | None = None
        self._forked: asyncio.Future[int] | None = None
        self._children: dict[int, ForkedChild] = {}
        self._ended_early: dict[int, int] = {}  # exit codes of children not yet registered (one that died at once)
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start the zygote process unless one runs (it loads in the background: `fork` waits for it)."""
        if self._reader is not None and not self._reader.done():
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        environment = {**self.environment(), ZYGOTE_FD_ENV: str(theirs.fileno())}
        passed = [theirs]
        cores = None
        if self._serves_cores:
            cores, their_cores = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            environment[CORE_FORKS_FD_ENV] = str(their_cores.fileno())
            passed.append(their_cores)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=2,  # what loading prints goes to the log: the worker's stderr (the output relay's pipe)
                env=environment,
                pass_fds=[end.fileno() for end in passed],
            )
        except BaseException:
            for end in (ours, cores):
                if end is not None:
                    end.close()
            raise
        finally:
            for end in passed:
                end.close()
        self._close_core_forks()
        if cores is not None:
            from nnqueue.enginecore.core_forks import CoreForks  # which imports this module

            self.core_forks = CoreForks(cores)
        ours.setblocking(False)
        self._socket = ours
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read(ours, self._ready))

    async def fork(self, ready_timeout_s: float) -> ForkedChild:
        """A new child, forked once the zygote is loaded (started now if none runs). Raises ``ConnectionError`` when
        the zygote dies first, ``TimeoutError`` when it is not loaded within ``ready_timeout_s``."""
        async with self._lock:
            await self.start()
            assert self._ready is not None and self._socket is not None and self._reader is not None
            await asyncio.wait_for(asyncio.shield(self._ready), ready_timeout_s)
            child_in, stdin = os.pipe()
            stdout, child_out = os.pipe()
            try:
                self._forked = asyncio.get_running_loop().create_future()
                socket.send_fds(self._socket, [b"F"], [child_in, child_out])
                pid = await self._forked
            except BaseException:
                os.close(stdin)
                os.close(stdout)
                raise
            finally:
                os.close(child_in)
                os.close(child_out)
            child = ForkedChild(pid, *await self._streams(stdin, stdout))
            code = self._ended_early.pop(pid, None)  # it died at once
            if code is None and self._reader.done():  # the zygote died meanwhile, and ended its children
                child.kill()
                code = -int(signal.SIGKILL)
            if code is None:
                self._children[pid] = child
            else:
                child.ended(code)
            return child

    async def close(self) -> None:
        """Stop the zygote; its children with it (its engine cores' server ends after them)."""
        self._close_core_forks()
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
        if self._reader is not None:
            await self._reader  # it waits for the process and ends the children

    def _close_core_forks(self) -> None:
        """Let the last zygote's core server go: it forks no more, and exits once its engine cores have ended."""
        if self.core_forks is not None:
            self.core_forks.close()
            self.core_forks = None

    async def _streams(self, stdin: int, stdout: int) -> tuple[asyncio.StreamWriter, asyncio.StreamReader]:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=self.limit)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(stdout, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), os.fdopen(stdin, "wb", 0)
        )
        return asyncio.StreamWriter(transport, protocol, None, loop), reader

    async def _read(self, ours: socket.socket, ready: asyncio.Future[None]) -> None:
        """The zygote's messages, until it dies: then its children are killed and ended, and waiting forks fail."""
        loop = asyncio.get_running_loop()
        try:
            while message := (await loop.sock_recv(ours, MESSAGE_BYTES)).decode(errors="replace"):
                kind, _, rest = message.partition(" ")
                if kind == "ready" and not ready.done():
                    ready.set_result(None)
                elif kind == "forked" and self._forked is not None and not self._forked.done():
                    self._forked.set_result(int(rest))
                elif kind == "exited":
                    pid, code = (int(field) for field in rest.split())
                    if (child := self._children.pop(pid, None)) is not None:
                        child.ended(code)
                    else:  # its fork's answer came first and `fork` has not registered it yet
                        self._ended_early[pid] = code
        except (OSError, ValueError):
            pass
        finally:
            ours.close()
            if self._process is not None:
                if self._process.returncode is None:
                    self._process.kill()
                await self._process.wait()
            died = ConnectionError(f"the {self.name} zygote died")
            for waiting in (ready, self._forked):
                if waiting is not None and not waiting.done():
                    waiting.set_exception(died)
                    waiting.exception()  # raised to whoever awaits it; no warning when nobody does
            for child in self._children.values():
                child.kill()
                child.ended(-int(signal.SIGKILL))
            self._children.clear()
