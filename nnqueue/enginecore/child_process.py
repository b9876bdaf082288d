"""The worker's child processes that run users' code, and the frames they speak on their stdin and stdout.

Two kinds of child run users' code outside the worker process, which holds the service's credentials: the
trace builders (:mod:`nnqueue.engines.trace_builder`: raw nnsight payloads rebuilt against a meta model) and
the transformers engine (:mod:`nnqueue.enginecore.transformers_engine`). Both are ``python -m <module>``,
spawned fresh (never forked from the worker: no copy of its heap comes along) with the worker's environment less its
secrets (`scrubbed_environment`); the builders are forked from such a process, their zygote, which loaded their model
once (``zygote=True``, :mod:`nnqueue.enginecore.zygote`). A child isolates itself (`open_protocol`: the engine's
filesystem view and no network but its own loopback, :mod:`nnqueue.enginecore.spawning`) and loads its model (a
spawned child in that order; a forked one's zygote loaded it), then enters the sandbox
(:func:`nnqueue.enginecore.sandbox.enter_child_sandbox`: no secret left, the engine user when the worker is
root, the seccomp filter, the protected environment) and only then says it is ready (`serve`).

Frames, both ways: an 8-byte big-endian length of what follows, a type byte, the body. The child writes
``READY`` once (JSON describing it), then answers each ``REQUEST`` with ``OK`` (the answer) or ``FAILED`` (the
request's error as JSON: type name, message, traceback). While it handles a request, a child may ask the worker
something first (`ask`: an ``ASK`` frame, answered by a ``REPLY``; a session's trace for the worker's engine to run,
:mod:`nnqueue.engines.sessions`), as often as it needs. The protocol owns the child's original stdout; what
user code prints goes to stderr, the worker's log.

The worker's side is :class:`ChildPool`: up to ``size`` children, started on first use (or ahead of it, by
:meth:`ChildPool.start` or :meth:`ChildPool.launch`) and reused. What a child sends is untrusted: frames are bounded and error reports
validated. A child that dies, breaks the protocol (a malformed frame, error report or answer) or whose
request is cancelled (its job timed out or was cancelled: its user code may be stuck) is killed and never
reused; so is one that died while idle. The next request starts a fresh one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from nnqueue import isolation
from nnqueue.enginecore import spawning
from nnqueue.enginecore.lifetime import exit_with_worker
from nnqueue.enginecore.zygote import ForkedChild, Zygote
from nnqueue.errors import NNqueueError

if TYPE_CHECKING:
    from nnqueue.enginecore.core_forks import CoreForks

log = logging.getLogger(__name__)
T = TypeVar("T")
Child = asyncio.subprocess.Process | ForkedChild

FRAME_HEADER = 8
OK, FAILED, READY, REQUEST, ASK, REPLY = 0, 1, 2, 3, 4, 5
READY_BYTES = 1 << 16
MAX_REPORT_TEXT = 1 << 16
STREAM_LIMIT = 1 << 20


def frame(kind: int, body: bytes) -> bytes:
    return (len(body) + 1).to_bytes(FRAME_HEADER, "big") + bytes([kind]) + body


# The child's side.


def write_frame(out: BinaryIO, kind: int, body: bytes) -> None:
    out.write(frame(kind, body))
    out.flush()


def read_frame(source: BinaryIO) -> tuple[int, bytes] | None:
    """One frame's type and body from ``source``, or None at the end of input."""
    header = source.read(FRAME_HEADER)
    if len(header) < FRAME_HEADER:
        return None
    size = int.from_bytes(header, "big")
    body = source.read(size)
    if len(body) != size or size < 1:
        return None
    return body[0], body[1:]


def open_protocol() -> BinaryIO:
    """What a child does first, while it has one thread: the engine's filesystem view and no network but its own
    loopback (:mod:`nnqueue.enginecore.spawning`), the original stdout kept for the protocol (returned) and stdout
    pointed at stderr, exit with the worker."""
    spawning.enter_if_asked()
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    exit_with_worker()
    return protocol


# The child's frames to the worker and the worker's to it, while `serve` runs (what `ask` uses).
_channel: list[BinaryIO] = []


def serve(protocol: BinaryIO, ready: dict[str, Any], handle: Callable[[bytes], bytes]) -> None:
    """Say the child is ready (``ready`` describes it, in the worker's log), then answer request frames from stdin
    until it closes: ``handle``'s answer, or the report of what it raised. Call it inside the sandbox."""
    write_frame(protocol, READY, json.dumps(ready).encode())
    requests = sys.stdin.buffer
    _channel[:] = [protocol, requests]
    while (request := read_frame(requests)) is not None:
        kind, body = request
        if kind != REQUEST:
            break
        try:
            answer = handle(body)
        except Exception as error:  # noqa: BLE001 - the request's error, whatever it is, goes to the worker
            write_frame(protocol, FAILED, error_report(error))
        else:
            write_frame(protocol, OK, answer)


def ask(question: bytes) -> bytes:
    """While `serve` handles a request: send the worker ``question`` and wait for its reply (the worker's ``ask``
    handler, :meth:`ChildPool.call`). Raises ``ConnectionError`` when the worker answers with anything else."""
    if not _channel:
        raise RuntimeError("ask() is for a child handling a request (serve)")
    protocol, requests = _channel
    write_frame(protocol, ASK, question)
    reply = read_frame(requests)
    if reply is None or reply[0] != REPLY:
        raise ConnectionError("the worker did not reply to the child's question")
    return reply[1]


def error_report(error: BaseException) -> bytes:
    """A ``FAILED`` frame's body: the error's type name (its ``type_name`` when it names another), message and
    traceback (its ``traceback_text`` when it carries another process's)."""
    return json.dumps(
        {
            "type_name": getattr(error, "type_name", type(error).__name__),
            "message": str(error),
            "traceback": getattr(error, "traceback_text", None) or "".join(traceback.format_exception(error)),
        }
    ).encode()


# The worker's side.


@dataclass
class ChildError(NNqueueError):
    """The error a child reported for one request (the child lives on)."""

    type_name: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class _AskFailed(NNqueueError):
    """What the worker's ``ask`` handler raised, carried past the child's own failures."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class ChildFailed(NNqueueError):
    """A child could not start (``started`` False), or died or broke the protocol during a request."""

    def __init__(self, message: str, started: bool = True) -> None:
        super().__init__(message)
        self.started = started


class ChildTimedOut(ChildFailed):
    """A child ran past the pool's ``answer_timeout_s`` without answering or asking (it was stopped)."""


def scrubbed_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: the worker's, without its credentials (:mod:`nnqueue.isolation`'s patterns,
    ``NNQUEUE_SECRET_ENV_PATTERNS`` included). The child then enters the sandbox itself."""
    environ = dict(os.environ if environ is None else environ)
    return isolation.without_secrets(environ, environ.get(isolation.EXTRA_SECRETS_ENV, "").split(","))


class ChildPool:
    """Up to ``size`` children running ``command`` (``[sys.executable, "-m", ...]``), named ``name`` in messages;
    use it on one event loop only."""

    def __init__(
        self,
        name: str,
        command: list[str],
        size: int,
        *,
        ready_timeout_s: float,
        max_answer_bytes: int,
        answer_timeout_s: float | None = None,
        zygote: bool = False,
        core_forks: bool = False,
    ) -> None:
        self.name, self.command = name, command
        # ``zygote``: ``command`` runs once, as a zygote (nnqueue.enginecore.zygote); the children are forked from it.
        # ``core_forks``: the zygote serves engine cores too (nnqueue.enginecore.core_forks).
        self._zygote = (
            Zygote(name, command, scrubbed_environment, STREAM_LIMIT, core_forks=core_forks) if zygote else None
        )
        self.ready_timeout_s, self.max_answer_bytes = ready_timeout_s, max_answer_bytes
        self.answer_timeout_s = answer_timeout_s
        self.size = size
        self._slots = asyncio.Semaphore(size)
        self._idle: list[Child] = []
        self._all: set[Child] = set()
        self._domains: dict[Child, str] = {}  # whose code each child has run
        self._settling: set[asyncio.Task[None]] = set()  # `retire_domains`' replacements (asyncio holds tasks weakly)

    @property
    def core_forks(self) -> CoreForks | None:
        """The current zygote's server of engine cores (None: none serves)."""
        return self._zygote.core_forks if self._zygote is not None else None

    async def start(self) -> None:
        """Start a child now (rather than at the first request) and wait until it is ready."""
        async with self._slots:
            if (child := self._take_idle()) is None:
                child = await self._spawn()
            self._idle.append(child)

    async def launch(self, count: int) -> asyncio.Task[None]:
        """Start ``count`` children (at most the pool's size) now, rather than at the first requests, and return the
        task that waits until they are ready; each then waits idle for a request, and one that does not start is only
        logged (the next request starts a fresh one). The processes run when this returns, so they load while the
        caller keeps its loop busy (a worker loading its engine); the task reads their READY frames once the loop
        runs again. Requests meanwhile wait for these children instead of starting more."""
        children: list[Child | None] = []  # None: forked from the zygote once it is loaded
        try:
            for _ in range(count):
                await self._slots.acquire()
                try:
                    children.append(None if self._zygote is not None else await self._launch())
                except BaseException:
                    self._slots.release()
                    raise
            if self._zygote is not None and children:
                await self._zygote.start()
        finally:
            settling = asyncio.ensure_future(self._settle(children))
        return settling

    async def call(
        self,
        request: bytes,
        doing: str,
        read: Callable[[bytes], T],
        ask: Callable[[bytes], Awaitable[bytes]] | None = None,
        *,
        domain: str | None = None,
        runs_code: bool = False,
    ) -> T:
        """``read`` of a child's answer to ``request``. Raises :class:`ChildError` with the error the child
        reported, :class:`ChildFailed` when it did not start, died, or broke the protocol (``read`` raising
        ``ValueError`` included: the answer is malformed); ``doing`` ("while ...") says when, in the message.
        ``ask``: what replies to the questions the child asks meanwhile (`ask`, child side); what it raises is raised
        here as it is, the child stopped. Without it a question breaks the protocol. With the pool's
        ``answer_timeout_s``, a child that runs that long without answering or asking (the time ``ask`` takes is not
        the child's) is stopped: :class:`ChildTimedOut`.

        ``domain``: the trust domain the request is made for. A child that ran a domain's code (``runs_code``) serves
        no other domain afterwards: whatever that code left in the process (an escape from the sandbox may change
        the child's own code) must not reach another domain's requests. A request of another domain gets a fresh
        child, an idle one of another domain stopped to make room. Without ``domain``, any child."""
        async with self._slots:
            child = await self._take(domain)
            if runs_code and domain is not None:
                self._domains[child] = domain
            stdin, stdout = child.stdin, child.stdout
            assert stdin is not None and stdout is not None
            try:
                stdin.write(frame(REQUEST, request))
                await stdin.drain()
                kind, answer = await self._answer(stdout)
                while kind == ASK and ask is not None:
                    try:
                        replied = await ask(answer)
                    except Exception as error:  # the asker's own failure: not the child's
                        raise _AskFailed(error) from error
                    stdin.write(frame(REPLY, replied))
                    await stdin.drain()
                    kind, answer = await self._answer(stdout)
                if kind not in (OK, FAILED):
                    raise ValueError(f"a frame of type {kind}")
                outcome = read(answer) if kind == OK else _reported_error(answer)
            except BaseException as error:
                code = await self._stop(child)
                if isinstance(error, _AskFailed):
                    raise error.error from None
                if isinstance(error, TimeoutError):
                    raise ChildTimedOut(
                        f"the {self.name} process ran {self.answer_timeout_s:g} s without answering {doing}"
                    ) from None
                if isinstance(error, (asyncio.IncompleteReadError, ConnectionError)):
                    raise ChildFailed(f"the {self.name} process died {doing} (exit code {code})") from None
                if isinstance(error, ValueError):
                    raise ChildFailed(f"the {self.name} process broke the protocol {doing} ({error})") from None
                raise  # cancelled: the job timed out or was cancelled
            self._idle.append(child)
            if isinstance(outcome, ChildError):
                raise outcome
            return outcome

    async def _answer(self, stdout: asyncio.StreamReader) -> tuple[int, bytes]:
        """A child's next frame, within the pool's ``answer_timeout_s`` (TimeoutError past it)."""
        return await asyncio.wait_for(_read_frame(stdout, self.max_answer_bytes), self.answer_timeout_s)

    async def retire_domains(self) -> int:
        """Stop the idle children that ran a trust domain's code, and start as many fresh ones (ready in the background,
        as `launch` starts them); how many. For a switch of the domain the children's requests come from (none is busy
        then): nothing of the old domain may stay behind beside the new one's."""
        retired = [child for child in self._idle if child in self._domains]
        for child in retired:
            self._idle.remove(child)
            await self._stop(child)
        if retired:
            settling = await self.launch(len(retired))
            self._settling.add(settling)
            settling.add_done_callback(self._settling.discard)
        return len(retired)

    async def close(self) -> None:
        for child in list(self._all):
            await self._stop(child)
        self._idle.clear()
        if self._zygote is not None:
            await self._zygote.close()

    async def _take(self, domain: str | None) -> Child:
        """A child for a request of ``domain``: an idle one that ran no other domain's code, or a fresh one (an idle
        child of another domain stopped first when the pool is full)."""
        if (child := self._take_idle(domain)) is not None:
            return child
        if len(self._all) >= self.size and (other := self._take_idle()) is not None:
            log.info("stopping %s process %d: it ran another trust domain's code", self.name, other.pid)
            await self._stop(other)
        return await self._spawn()

    def _take_idle(self, domain: str | None = None) -> Child | None:
        """An idle child that is still alive (one that died idle is dropped) and, for ``domain``, ran no other
        domain's code."""
        for child in list(self._idle):
            if child.returncode is not None:
                self._idle.remove(child)
                self._all.discard(child)
                self._domains.pop(child, None)
                log.warning("the %s process %d died while idle (exit code %s)", self.name, child.pid, child.returncode)
        # One that already ran the domain's code first, so that fresh ones stay for the other domains.
        ranked = sorted(reversed(self._idle), key=lambda child: self._domains.get(child) != domain)
        for child in ranked:
            if domain is None or self._domains.get(child, domain) == domain:
                self._idle.remove(child)
                return child
        return None

    async def _settle(self, children: list[Child | None]) -> None:
        """Wait until each of ``children`` (launched, or None: to fork; each holding a slot) is ready, and leave it
        idle."""
        for child in children:
            try:
                child = child or await self._launch()
                await self._ready(child)
            except ChildFailed as failed:
                log.warning("%s", failed)
            else:
                self._idle.append(child)
            finally:
                self._slots.release()

    async def _spawn(self) -> Child:
        child = await self._launch()
        await self._ready(child)
        return child

    async def _launch(self) -> Child:
        child: Child
        if self._zygote is not None:
            try:
                child = await self._zygote.fork(self.ready_timeout_s)
            except (ConnectionError, TimeoutError) as error:
                raise ChildFailed(f"the {self.name} process did not start: {error!r}", started=False) from None
        else:
            child = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=scrubbed_environment(),
                limit=STREAM_LIMIT,
            )
        self._all.add(child)
        return child

    async def _ready(self, child: Child) -> None:
        """Wait for ``child``'s READY frame; it is killed, and :class:`ChildFailed` raised, if none comes in time."""
        assert child.stdout is not None
        try:
            kind, body = await asyncio.wait_for(_read_frame(child.stdout, READY_BYTES), self.ready_timeout_s)
            if kind != READY:
                raise ValueError(f"a frame of type {kind}")
        except BaseException as error:
            await self._stop(child)
            if isinstance(error, asyncio.CancelledError):
                raise
            raise ChildFailed(f"the {self.name} process did not start: {error!r}", started=False) from None
        log.info("%s process %d ready (%s)", self.name, child.pid, body.decode(errors="replace"))

    async def _stop(self, child: Child) -> int:
        """Kill ``child`` (if it still runs) and wait for it; its exit code."""
        self._all.discard(child)
        self._domains.pop(child, None)
        if child.returncode is None:
            child.kill()
        return await child.wait()


async def _read_frame(stream: asyncio.StreamReader, limit: int) -> tuple[int, bytes]:
    """A frame's type and body, the body at most ``limit`` bytes; ``ValueError`` for a larger one."""
    size = int.from_bytes(await stream.readexactly(FRAME_HEADER), "big")
    if not 1 <= size <= limit + 1:
        raise ValueError(f"a frame of {size} bytes")
    body = await stream.readexactly(size)
    return body[0], body[1:]


def _reported_error(body: bytes) -> ChildError:
    """A ``FAILED`` frame's report (untrusted JSON); ``ValueError`` when it is malformed."""
    raw = json.loads(body)
    fields = [raw.get(name) for name in ("type_name", "message", "traceback")] if isinstance(raw, dict) else []
    texts = [value[:MAX_REPORT_TEXT] for value in fields if isinstance(value, str)]
    if len(texts) != 3:
        raise ValueError("a malformed error report")
    type_name, message, trace = texts
    return ChildError(type_name[:200], message, trace)
