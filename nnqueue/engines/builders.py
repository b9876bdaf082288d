"""A pool of sandboxed processes that turn raw nnsight payloads into prebuilt ones.

Rebuilding a raw payload unpickles user bytes and runs the trace's top-level code, which must never
happen in the worker process (it holds the database, broker and object-store credentials). Each builder
is ``python -m nnqueue.engines.trace_builder`` (:mod:`nnqueue.engines.trace_builder`), holding a meta ``VLLM``
of the worker's model, a child process of :mod:`nnqueue.enginecore.child_process` (its environment without
those credentials, its sandbox, its frames). Its output is untrusted: the worker parses it with the same
safe parser as a client's payload.

Builders also check prebuilt payloads (`BuilderPool.check`): they load each mediator as the engine will, so
one the engine cannot load fails its job at claim instead of reaching the engine. And they run sessions
(`BuilderPool.run_session`, :mod:`nnqueue.engines.sessions`): the body in a builder, each of its traces on the
worker's engine.

A builder that ran a trust domain's code (a raw payload's top-level code, a session's body) serves only that domain
from then on, so that what the code left in it cannot reach another domain's builds: another domain's request gets
a fresh builder (:meth:`ChildPool.call`), and when the
engine switches domains every builder that ran a domain's code is replaced (`retire_domains`), so none stays idle
beside the next domain's work. Checks run no user code and can use any builder that ran none of another domain's.

Builders are forked from the pool's zygote (:mod:`nnqueue.enginecore.zygote`), the same program, which loads the meta
model once (13.8 s of CPU on a 2-core machine, paid by each builder when each loaded its own): a fresh builder is ready
0.3-0.7 s after it is asked for, so a domain's switch or a killed builder costs no model load. A worker starts the
zygote and all ``size`` builders while its engine loads (`BuilderPool.launch`), so its first trace job finds one ready;
otherwise builders start on first use, up to ``size`` at once. They are reused. A build that fails raises the builder's
error (:class:`~nnqueue.enginecore.child_process.ChildError`); a builder that dies, or whose build is cancelled
(the job timed out or was cancelled: its user code may be stuck), is killed and replaced by a fresh one on the
next build. So is one that runs a job's code for ``timeout_s`` (``NNQUEUE_TRACE_BUILDER_TIMEOUT_S``) without
answering: a payload's top-level code, or a session's body between two of its traces. The job holds the engine
for its trust domain while it runs, so without this bound a job that sleeps there would keep every other domain
waiting until its own timeout (``TraceBuilderTimedOut``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from nnqueue.enginecore.child_process import ChildError, ChildFailed, ChildPool, ChildTimedOut
from nnqueue.engines import sessions

if TYPE_CHECKING:
    from nnqueue.enginecore.core_forks import CoreForks

READY_TIMEOUT_S = 900.0


class BuilderPool:
    """Up to ``size`` builder processes for ``model``; use it only on one event loop."""

    def __init__(
        self,
        model: str,
        engine_kwargs: dict[str, Any],
        size: int,
        max_output_bytes: int,
        timeout_s: float | None = None,
    ) -> None:
        # The meta model needs the checkpoint's shape, not the engine's execution settings.
        engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "distributed_executor_backend"}
        command = [sys.executable, "-m", "nnqueue.engines.trace_builder", "--model", model]
        command += ["--engine-kwargs", json.dumps(engine_kwargs)]
        self.size = size
        self._sessions = asyncio.Semaphore(max(size - 1, 1))
        self._pool = ChildPool(
            "trace builder",
            command,
            size,
            ready_timeout_s=READY_TIMEOUT_S,
            max_answer_bytes=max_output_bytes,
            answer_timeout_s=timeout_s,
            zygote=True,
            core_forks=True,
        )

    @property
    def core_forks(self) -> CoreForks | None:
        """Where the engine core starts when its zygote serves one (:mod:`nnqueue.enginecore.core_forks`)."""
        return self._pool.core_forks

    async def launch(self) -> asyncio.Task[None]:
        """Start every builder now; returns the task that waits until they are ready (:meth:`ChildPool.launch`: they
        load while the caller's loop is busy, and a builder that does not start is logged and replaced on use)."""
        return await self._pool.launch(self.size)

    async def build(self, payload: bytes, domain: str) -> bytes:
        """The prebuilt payload for a raw one of trust domain ``domain`` (its mediators checked as `check` does);
        raises :class:`ChildError`."""
        if self.size < 1:
            raise ChildError(
                "RawPayloadRefused",
                "this worker has no trace builders (NNQUEUE_TRACE_BUILDERS=0), so it runs only payloads"
                " prebuilt by the nnqueue client",
            )
        return await self._call(payload, domain, runs_code=True)

    async def run_session(
        self, payload: bytes, domain: str, sinks: dict[str, Any], run_trace: Callable[[bytes], Awaitable[bytes]]
    ) -> bytes:
        """Run the raw session ``payload`` in a builder (:mod:`nnqueue.engines.sessions`), its result written to
        ``sinks``; ``run_trace`` runs each of its traces (a prebuilt payload) and replies (`sessions.reply`). The
        answer is the result's report. A builder is always left for the others' builds and checks (each of a
        session's traces is checked in another builder): at most ``size - 1`` sessions run at once, and a worker with
        fewer than two builders refuses sessions. Raises :class:`ChildError`."""
        if self.size < 2:
            raise ChildError(
                "SessionRefused",
                f"this worker has {self.size} trace builder(s) (NNQUEUE_TRACE_BUILDERS): a session needs two, one"
                " for its body and one to check each of its traces",
            )
        async with self._sessions:
            request = sessions.request(payload, sinks)
            return await self._call(request, domain, "while running this session", run_trace, runs_code=True)

    async def check(self, payload: bytes, domain: str) -> None:
        """Load a prebuilt payload's mediators (of trust domain ``domain``) in a builder as the engine will; raises
        :class:`ChildError` naming the invoke whose mediator cannot be loaded. Without builders (``size`` 0) it
        checks nothing: the engine then fails such a request alone (``protected.load_mediator``)."""
        if self.size >= 1:
            await self._call(payload, domain)

    async def _call(
        self,
        payload: bytes,
        domain: str,
        doing: str = "while rebuilding this trace",
        ask: Callable[[bytes], Awaitable[bytes]] | None = None,
        *,
        runs_code: bool = False,
    ) -> bytes:
        """A builder's answer. A builder that ran a domain's code (a build, a session: ``runs_code``) serves only that
        domain afterwards (:meth:`ChildPool.call`); a check runs no code of the payload's (its strict unpickler builds
        nothing but what reconstructors make), so it leaves a fresh builder fresh."""
        try:
            return await self._pool.call(payload, doing, lambda built: built, ask, domain=domain, runs_code=runs_code)
        except ChildTimedOut as silent:
            raise ChildError(
                "TraceBuilderTimedOut",
                f"{silent} (NNQUEUE_TRACE_BUILDER_TIMEOUT_S): the job's own Python there (a payload's top-level code,"
                " a session's body between its traces) holds the engine for its trust domain meanwhile",
            ) from None
        except ChildFailed as failed:
            raise ChildError(
                "TraceBuilderCrashed" if failed.started else "TraceBuilderUnavailable", str(failed)
            ) from None

    async def retire_domains(self) -> int:
        """At a switch of the engine's trust domain: stop the builders that ran any domain's code, fresh ones in their
        place (:meth:`ChildPool.retire_domains`); how many."""
        return await self._pool.retire_domains()

    async def close(self) -> None:
        await self._pool.close()
