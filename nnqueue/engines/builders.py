"""A pool of sandboxed processes that turn raw nnsight payloads into prebuilt ones.

Rebuilding a raw payload unpickles user bytes and runs the trace's top-level code, which must never
happen in the worker process (it holds the database, broker and object-store credentials). Each builder
is ``python -m nnqueue.engines.trace_builder`` (:mod:`nnqueue.engines.trace_builder`), started with an
environment from which those credentials are removed, holding a meta ``VLLM`` of the worker's model. Its
output is untrusted: the worker parses it with the same safe parser as a client's payload.

Builders also check prebuilt payloads (`BuilderPool.check`): they load each mediator as the engine will, so
one the engine cannot load fails its job at claim instead of reaching the engine.

Builders start on first use, up to ``size`` at once, and are reused. A build that fails returns the builder's error; a builder that dies,
or whose build is cancelled (the job timed out or was cancelled: its user code may be stuck), is killed
and replaced by a fresh one on the next build.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from nnqueue import isolation
from nnqueue.engines import trace_builder
from nnqueue.errors import NNqueueError

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 900.0


def scrubbed_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The builder's environment: the worker's, without its credentials (``nnqueue.isolation``'s patterns,
    ``NNQUEUE_SECRET_ENV_PATTERNS`` included). The builder itself then drops to the engine user."""
    environ = dict(os.environ if environ is None else environ)
    return isolation.without_secrets(environ, environ.get(isolation.EXTRA_SECRETS_ENV, "").split(","))


@dataclass
class BuildFailed(NNqueueError):
    """The raw payload could not be rebuilt; the fields describe the builder's error."""

    type_name: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class _Builder:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def call(self, payload: bytes, max_output_bytes: int) -> bytes:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(len(payload).to_bytes(trace_builder.FRAME_HEADER, "big") + payload)
        await stdin.drain()
        status, body = await _read_frame(stdout, max_output_bytes)
        if status == trace_builder.OK:
            return body
        raise _failure(body)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


class BuilderPool:
    """Up to ``size`` builder processes for ``model``; use it only on one event loop."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], size: int, max_output_bytes: int) -> None:
        self.model = model
        # The meta model needs the checkpoint's shape, not the engine's execution settings.
        self.engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "distributed_executor_backend"}
        self.size = size
        self.max_output_bytes = max_output_bytes
        self._idle: list[_Builder] = []
        self._slots: asyncio.Semaphore | None = None
        self._all: set[_Builder] = set()

    async def build(self, payload: bytes) -> bytes:
        """The prebuilt payload for a raw one (its mediators checked as `check` does); raises :class:`BuildFailed`."""
        if self.size < 1:
            raise BuildFailed(
                "RawPayloadRefused",
                "this worker has no trace builders (NNQUEUE_TRACE_BUILDERS=0), so it runs only payloads"
                " prebuilt by the nnqueue client",
            )
        return await self._call(payload)

    async def check(self, payload: bytes) -> None:
        """Load a prebuilt payload's mediators in a builder as the engine will; raises :class:`BuildFailed` naming
        the invoke whose mediator cannot be loaded. Without builders (``size`` 0) it checks nothing: the engine
        then fails such a request alone (``protected.load_mediator``)."""
        if self.size >= 1:
            await self._call(payload)

    async def _call(self, payload: bytes) -> bytes:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            builder = self._idle.pop() if self._idle else await self._start()
            try:
                built = await builder.call(payload, self.max_output_bytes)
            except BuildFailed:
                self._idle.append(builder)
                raise
            except BaseException as error:
                # Cancelled mid-build, or the process died or broke the protocol: never reuse it.
                builder.kill()
                self._all.discard(builder)
                if isinstance(error, (asyncio.IncompleteReadError, ConnectionError, ValueError)):
                    code = await builder.process.wait()
                    raise BuildFailed(
                        "TraceBuilderCrashed",
                        f"the trace builder process died while rebuilding this trace (exit code {code})",
                    ) from None
                raise
            self._idle.append(builder)
            return built

    async def close(self) -> None:
        for builder in list(self._all):
            builder.kill()
            await builder.process.wait()
        self._all.clear()
        self._idle.clear()

    async def _start(self) -> _Builder:
        command = [sys.executable, "-m", "nnqueue.engines.trace_builder", "--model", self.model]
        command += ["--engine-kwargs", json.dumps(self.engine_kwargs)]
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=scrubbed_environment(),
            limit=1 << 20,
        )
        builder = _Builder(process)
        self._all.add(builder)
        assert process.stdout is not None
        try:
            status, body = await asyncio.wait_for(_read_frame(process.stdout, 1 << 16), READY_TIMEOUT_S)
            if status != trace_builder.READY:
                raise ValueError(f"unexpected frame {status}")
        except BaseException as error:
            builder.kill()
            self._all.discard(builder)
            if isinstance(error, asyncio.CancelledError):
                raise
            raise BuildFailed(
                "TraceBuilderUnavailable", f"the trace builder process did not start: {error!r}"
            ) from None
        log.info("trace builder %d ready (%s)", process.pid, body.decode(errors="replace"))
        return builder


async def _read_frame(stream: asyncio.StreamReader, limit: int) -> tuple[int, bytes]:
    size = int.from_bytes(await stream.readexactly(trace_builder.FRAME_HEADER), "big")
    if not 1 <= size <= limit + 1:
        raise ValueError(f"a trace builder answered with a frame of {size} bytes")
    body = await stream.readexactly(size)
    return body[0], body[1:]


def _failure(body: bytes) -> BuildFailed:
    """The builder's error report (untrusted JSON) as a BuildFailed."""
    try:
        raw = json.loads(body)
    except ValueError:
        raw = None
    if not isinstance(raw, dict):
        return BuildFailed("TraceBuilderError", "the trace builder sent an unreadable error report")
    fields = [raw.get(name) for name in ("type_name", "message", "traceback")]
    texts = [value[:65536] for value in fields if isinstance(value, str)]
    if len(texts) != len(fields):
        return BuildFailed("TraceBuilderError", "the trace builder sent a malformed error report")
    type_name, message, traceback = texts
    return BuildFailed(type_name[:200], message, traceback)
