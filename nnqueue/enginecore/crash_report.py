"""The engine says which requests were in the step that killed it.

An exception in a forward that nnsight cannot defer to one request (a ``.skip()`` value of the wrong
shape makes vLLM's own code fail, say) kills vLLM's engine core: every request on it ends with
``EngineDeadError``, and nothing says whose trace did it. This mixin, in both engine worker classes,
remembers the request ids of the step being run (``scheduler_output.num_scheduled_tokens``, vLLM 0.32
and 0.24) and, when ``execute_model`` or ``sample_tokens`` raises, writes them with the error to a small
JSON file in ``$NNQUEUE_CRASH_REPORT_DIR`` before the exception goes on to kill the engine. The worker
process reads it (:mod:`nnqueue.workers.engine_health`) to fail the job that crashed the engine and
no other.

The report also says what failed (`cause`): ``"host"`` when the error, or one it was raised from, is the
host's set-up failing (a file it may not read, a module it cannot import, torch's compiler failing:
`HOST_ERRORS`) raised outside a trace's own code; ``"trace"`` when a frame of the error's traceback is the
code of a trace in the step (nnsight compiles a trace's block under its author's file name, kept on its
mediator's ``code``); else ``"engine"`` (vLLM's or torch's own code failed on what the step's traces
gave it: a ``.skip()`` value of the wrong shape, say).

The report comes from a process that runs users' code, so the worker treats it as a claim, not a fact:
it only narrows down which of the worker's own running jobs were in the step, and words the error.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnqueue.enginecore import untrusted_files

if TYPE_CHECKING:  # the mixin goes before a vLLM worker class in the bases
    from vllm.v1.worker.worker_base import WorkerBase as _Worker
else:
    _Worker = object

CRASH_DIR_ENV = "NNQUEUE_CRASH_REPORT_DIR"
# Errors that say the host's set-up failed, not the code a trace brought: by class, and by name for those
# whose class lives in a package this module does not import (torch._inductor's InductorError, dynamo's
# BackendCompilerFailed wrap the compiler's own error).
HOST_ERRORS: tuple[type[BaseException], ...] = (PermissionError, ImportError, MemoryError)
HOST_ERROR_NAMES = frozenset({"InductorError", "BackendCompilerFailed", "OutOfMemoryError"})


def write_report(request_ids: list[str], error: BaseException, files: frozenset[str] = frozenset()) -> None:
    """Write ``crash-<pid>.json`` (atomically) into the crash report directory, if one is configured.

    ``files``: the file names the step's traces were compiled under (`trace_files`).
    """
    directory = os.environ.get(CRASH_DIR_ENV)
    if not directory:
        return
    cause, where = classify(error, files)
    report = {
        "request_ids": request_ids,
        "error": f"{type(error).__name__}: {error}"[:2000],
        "cause": cause,
        "where": where,
        "traceback": "".join(traceback.format_exception(error))[-8000:],
    }
    save_report(Path(directory), os.getpid(), report)


def save_report(directory: Path, pid: int, report: dict[str, Any]) -> None:
    """Write ``report`` as engine process ``pid``'s crash report in ``directory``, atomically. The worker writes
    one itself for an engine process that it kills (:mod:`nnqueue.workers.stall_deadline`: ``cause`` "stall"),
    following nothing the engine put there (:mod:`nnqueue.enginecore.untrusted_files`)."""
    untrusted_files.write(directory, f"crash-{pid}.json", json.dumps(report).encode())


def classify(error: BaseException, trace_files: frozenset[str]) -> tuple[str, str | None]:
    """``(cause, where)``: ``("host", "<error>")`` when a host error (`HOST_ERRORS`) in the chain was raised
    outside a trace's code (a module a library imports, a file torch's compiler reads: a trace's own ``import``
    or ``open`` is the trace's), else ``("trace", "file:line")`` when a trace's frame raised or called into the
    failure, else ``("engine", None)``."""
    chain = list(_chain(error))
    for each in chain:
        if isinstance(each, HOST_ERRORS) or type(each).__name__ in HOST_ERROR_NAMES:
            stack = traceback.extract_tb(each.__traceback__)
            if not stack or stack[-1].filename not in trace_files:
                return "host", f"{type(each).__name__}: {each}"[:2000]
    for each in chain:
        frames = [frame for frame in traceback.extract_tb(each.__traceback__) if frame.filename in trace_files]
        if frames:  # the innermost: the line of the trace that raised or called into the failure
            return "trace", f"{frames[-1].filename}:{frames[-1].lineno}"
    return "engine", None


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from or during, innermost last (each once)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def trace_files(runner: Any) -> frozenset[str]:
    """The file names the code of the traces on ``runner`` (nnsight's model runner) was compiled under."""
    requests = getattr(getattr(runner, "nnsight_requests", None), "requests", {})
    files = set()
    for request in list(requests.values()):
        code = getattr(getattr(request, "mediator", None), "code", None)
        if code is not None:
            files.add(code.co_filename)
    return frozenset(files)


class CrashReportingWorker(_Worker):
    """Mixin for vLLM worker classes; see the module doc."""

    _nnqueue_step: tuple[str, ...] = ()

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._nnqueue_step = tuple(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        except Exception as error:
            write_report(list(self._nnqueue_step), error, trace_files(getattr(self, "model_runner", None)))
            raise

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().sample_tokens(*args, **kwargs)
        except Exception as error:
            write_report(list(self._nnqueue_step), error, trace_files(getattr(self, "model_runner", None)))
            raise
