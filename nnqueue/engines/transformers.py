"""The worker's side of the transformers engine: the engine process, started, fed one job at a time, replaced.

The engine process (:mod:`nnqueue.enginecore.transformers_engine`) holds the Hugging Face model and runs
users' code, so it starts with the worker's secrets removed from its environment (the trace builders' scrub,
:func:`nnqueue.engines.builders.scrubbed_environment`) and is spawned fresh (never forked from the worker). It
writes each job's result to the handoff files it is given (:mod:`nnqueue.workers.sinks`), reporting their sizes,
which the caller checks when it uploads them.

A job the caller abandons (its timeout passed, it was cancelled: its code may be stuck) kills the process,
and so does a protocol error; the next job starts a new one (loading the model again). A process that dies
by itself fails only the job it was running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

from nnqueue.enginecore import transformers_engine as wire
from nnqueue.engines.builders import scrubbed_environment
from nnqueue.engines.trace_runner import SHA256, WrittenObject
from nnqueue.errors import NNqueueError

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 1800.0
MAX_ANSWER_BYTES = 1 << 24


class EngineFailed(NNqueueError):
    """The engine process could not start, died, or broke the protocol."""


@dataclass(frozen=True)
class Ran:
    """A job's outcome in the engine: the objects it wrote to its sinks (name -> size and sha256) and its error."""

    objects: dict[str, WrittenObject]
    error: dict[str, Any] | None
    load_failed: bool = False  # the payload could not be rebuilt against the model


class TransformersEngine:
    """One engine process for ``model``, started on first use; use it from one event loop, one job at a time."""

    def __init__(self, model: str, model_kwargs: dict[str, Any], stall_timeout_s: float) -> None:
        self.model, self.model_kwargs, self.stall_timeout_s = model, model_kwargs, stall_timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Start the engine process now (rather than at the first job) and wait until its model is loaded."""
        async with self._lock:
            await self._ensure()

    async def run(self, job_id: str, env: dict[str, Any], payload: bytes, sinks: dict[str, Any]) -> Ran:
        """Run one job, its result written to ``sinks``; raises :class:`EngineFailed` when the process fails it.
        Cancelling kills the process."""
        async with self._lock:
            process = await self._ensure()
            header = {"job": job_id, "env": env, "sinks": sinks}
            try:
                assert process.stdin is not None and process.stdout is not None
                body = wire.job_frame(header, payload)
                process.stdin.write((len(body) + 1).to_bytes(wire.FRAME_HEADER, "big") + bytes([wire.JOB]) + body)
                await process.stdin.drain()
                kind, answer = await _read_frame(process.stdout)
                if kind != wire.DONE:
                    raise EngineFailed(f"the engine process answered with a frame of type {kind}")
                return _ran(json.loads(answer), set(sinks))
            except BaseException as error:
                await self._kill()
                if isinstance(error, (asyncio.IncompleteReadError, ConnectionError, ValueError)):
                    raise EngineFailed(f"the engine process died while running job {job_id}: {error!r}") from None
                raise

    async def close(self) -> None:
        await self._kill()

    async def _ensure(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        command = [sys.executable, "-m", "nnqueue.enginecore.transformers_engine", "--model", self.model]
        command += ["--model-kwargs", json.dumps(self.model_kwargs), "--stall-timeout-s", str(self.stall_timeout_s)]
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=scrubbed_environment()
        )
        self._process = process
        assert process.stdout is not None
        try:
            kind, body = await asyncio.wait_for(_read_frame(process.stdout), READY_TIMEOUT_S)
            if kind != wire.READY:
                raise ValueError(f"unexpected frame of type {kind}")
        except BaseException as error:
            await self._kill()
            if isinstance(error, asyncio.CancelledError):
                raise
            raise EngineFailed(f"the transformers engine process did not start: {error!r}") from None
        log.info("transformers engine %d ready for %s (%s)", process.pid, self.model, body.decode(errors="replace"))
        return process

    async def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()


async def _read_frame(stream: asyncio.StreamReader) -> tuple[int, bytes]:
    size = int.from_bytes(await stream.readexactly(wire.FRAME_HEADER), "big")
    if not 1 <= size <= MAX_ANSWER_BYTES:
        raise ValueError(f"the engine process sent a frame of {size} bytes")
    body = await stream.readexactly(size)
    return body[0], body[1:]


def _ran(answer: Any, sinks: set[str]) -> Ran:
    """The engine's answer (untrusted JSON), checked against the sinks it was given."""
    if not isinstance(answer, dict) or not isinstance(answer.get("objects"), dict):
        raise ValueError("the engine process sent a malformed answer")
    written: dict[str, WrittenObject] = {}
    for name, info in answer["objects"].items():
        if (
            name not in sinks
            or not isinstance(info, dict)
            or not isinstance(info.get("size"), int)
            or not isinstance(info.get("sha256"), str)
            or not SHA256.fullmatch(info["sha256"])
        ):
            raise ValueError(f"the engine process reported an unknown or malformed object {name!r}")
        written[name] = WrittenObject(info["size"], info["sha256"])
    error = answer.get("error")
    if error is not None:
        if not isinstance(error, dict):
            raise ValueError("the engine process sent a malformed error")
        error = {key: str(error.get(key, ""))[:65536] for key in ("type_name", "message", "traceback")} | {
            "is_control_flow": bool(error.get("is_control_flow"))
        }
    return Ran(written, error, bool(answer.get("load_failed")))
